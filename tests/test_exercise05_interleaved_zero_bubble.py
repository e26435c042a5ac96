"""Exercise 05: the zero-bubble schedule ZB-H1, judged on 3 ranks by running it: the answer's lists are
executed by the pipeline runner (I and W split: the input's gradient first, the weights' later), and the
lesson's claims are checked: every rank's order is a valid schedule with every backward split into I and
W; the gradients and parameters equal the unsplit model's on the whole batch (float64, rtol 1e-10); the
bubble counted in the schedule's grid is (P-1)/(3M+P-1); and rank r holds min(M, P) micro-batches,
measured while running (M = 4 > P)."""

from pathlib import Path

from exercise_kit import Answer, exercise_tests, judge

from distlab.compare import all_ok, compare
from distlab.pipeline.runner import PipelineStep
from distlab.pipeline.schedules import Action, check_schedule, split_backward
from distlab.pipeline.simulator import simulate
from distlab.pipeline.training import PipelineConfig, train, unsplit_reference

LESSON, NAME = "05_interleaved_zero_bubble", "zb_h1"
P, M = 3, 4
CFG = PipelineConfig(
    widths=(4, *[6] * 5, 3), global_batch=8, micro_batches=M, steps=2, lr=0.2, seed=3, gather_spans=False
)


def _valid(schedule) -> tuple[bool, str]:
    """check_schedule: F and I once per micro-batch and stage; every (stage, i) split; simulate: no deadlock."""
    try:
        if len(schedule) != P or check_schedule(schedule) != M:
            return False, f"not {P} ranks' lists over {M} micro-batches"
        if split_backward(schedule) != {(p, i) for p in range(P) for i in range(M)}:
            return False, "some backward has no W: every I must be followed, later, by its W"
        return simulate(schedule).ticks > 0, ""
    except ValueError as err:
        return False, str(err)


def _ranks(rt, zb_h1, claims) -> None:
    schedule = zb_h1(P, M)
    ok, why = _valid(schedule)
    if not claims.check(
        "every rank's order is a schedule (F, I and W once per micro-batch, no deadlock)",
        ok,
        why,
        "rank r's actions are Action(kind, i, r); W_i after I_i after F_i",
    ):
        return
    run, ref = train(rt, CFG, PipelineStep(rt, CFG, schedule)), unsplit_reference(CFG)
    exact = all_ok(compare({n: ref.first_grads[n] for n in run.first_grads}, run.first_grads)) and all_ok(
        compare({n: ref.params[n] for n in run.params}, run.params)
    )
    claims.check(
        "the gradients and parameters equal the unsplit model's",
        exact,
        "",
        "every micro-batch must run its F, I and W exactly once",
    )
    bubble, formula = simulate(schedule).bubble_fraction(), (P - 1) / (3 * M + P - 1)
    claims.check(
        "the bubble counted in the grid is (P-1)/(3M+P-1)",
        abs(bubble - formula) < 1e-12,
        f"{bubble:.4f}, not {formula:.4f}",
        "rank r holds back r W's: run the oldest only once more than r wait, the rest at the end",
    )
    held, most = run.peak_in_flight, min(M, P)
    claims.check(
        "rank r holds min(M, P) micro-batches",
        held == most,
        f"rank {rt.rank} held {held}, not {most}",
        "start the I's after min(P - r - 1, M) warm-up forwards, then alternate",
    )


def check(answer: Answer) -> None:
    judge(_ranks, P, answer)


def w_right_after_i(num_ranks: int, microbatches: int):
    """A wrong answer: 1F1B with every backward split but no W held back (W_i straight after I_i): exact
    gradients, but nothing fills 1F1B's idle ticks."""
    schedule = []
    for r in range(num_ranks):
        warmup = min(num_ranks - r - 1, microbatches)
        order = [Action("F", i, r) for i in range(warmup)]
        for i in range(microbatches):
            if warmup + i < microbatches:
                order.append(Action("F", warmup + i, r))
            order += [Action("I", i, r), Action("W", i, r)]
        schedule.append(order)
    return schedule


test_exercise, test_the_judge_rejects_a_blank_and_a_wrong_answer = exercise_tests(
    LESSON,
    NAME,
    check,
    wrong=Answer(Path(__file__), "w_right_after_i"),
    wrong_claim=r"the bubble counted in the grid is \(P-1\)/\(3M\+P-1\)",
)
