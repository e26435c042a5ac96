"""Exercise 02: the GPipe schedule, judged on 3 ranks by running it: the answer's lists are executed by
the pipeline runner, with and without activation checkpointing (K = 2), and the lesson's claims are
checked: every rank's order is a valid schedule; the gradients and parameters equal the unsplit model's
on the whole batch (float64, rtol 1e-10; N = 7 rows, so the micro-batches are uneven); the bubble counted
in the schedule's grid is (P-1)/(M+P-1); every rank holds all M micro-batches at once, measured while
running; and checkpointing holds fewer activation bytes (a stage of 4 layers in 2 segments of 2)."""

from pathlib import Path

from exercise_kit import Answer, exercise_tests, judge

from distlab.compare import all_ok, compare
from distlab.pipeline.runner import PipelineStep
from distlab.pipeline.schedules import Action, check_schedule
from distlab.pipeline.simulator import simulate
from distlab.pipeline.training import PipelineConfig, train, unsplit_reference

LESSON, NAME = "02_gpipe_checkpoint", "gpipe"
P, M = 3, 3
CFG = PipelineConfig(
    widths=(4, *[6] * 11, 3), global_batch=7, micro_batches=M, steps=2, lr=0.2, seed=3, probe=True, gather_spans=False
)  # 12 layers: 4 per stage, K = 2 segments of 2


def _ranks(rt, gpipe, claims) -> None:
    schedule, why = gpipe(P, M), f"not {P} ranks' lists"
    try:  # check_schedule: F and I once per micro-batch and stage; simulate: no deadlock
        ok = len(schedule) == P and check_schedule(schedule) == M and simulate(schedule).ticks > 0
    except ValueError as err:
        ok, why = False, str(err)
    if not claims.check(
        "every rank's order is a schedule (F and I once per micro-batch, no deadlock)",
        ok,
        "" if ok else why,
        "rank r's actions are Action(kind, i, r); I_i after F_i",
    ):
        return
    ref, runs = unsplit_reference(CFG), {}
    for k in (0, 2):
        cfg = CFG.replace(checkpoint_segments=k)
        runs[k] = run = train(rt, cfg, PipelineStep(rt, cfg, schedule))
        exact = all_ok(compare({n: ref.first_grads[n] for n in run.first_grads}, run.first_grads)) and all_ok(
            compare({n: ref.params[n] for n in run.params}, run.params)
        )
        claims.check(
            f"K={k}: the gradients and parameters equal the unsplit model's",
            exact,
            "",
            "every micro-batch must run its F and I exactly once",
        )
    bubble, formula = simulate(schedule).bubble_fraction(), (P - 1) / (M + P - 1)
    claims.check(
        "the bubble counted in the grid is (P-1)/(M+P-1)",
        abs(bubble - formula) < 1e-12,
        f"{bubble:.4f}, not {formula:.4f}",
        "run every forward before any backward: the pipeline fills",
    )
    held = runs[0].peak_in_flight
    claims.check(
        "every rank holds all M micro-batches at once",
        held == M,
        f"rank {rt.rank} held {held}, not {M}",
        "GPipe starts no backward before its last forward",
    )
    plain, ckpt = runs[0].saved_peak_bytes, runs[2].saved_peak_bytes
    claims.check(
        "checkpointing (K=2) holds fewer activation bytes",
        ckpt < plain,
        f"{ckpt} B, not < {plain} B",
        "the runner checkpoints what your schedule holds: all M forwards must be in flight together",
    )


def check(answer: Answer) -> None:
    judge(_ranks, P, answer)


def one_at_a_time(num_ranks: int, microbatches: int):
    """A wrong answer: each micro-batch down and back before the next (F_0 I_0 F_1 I_1 ...): exact
    gradients, but the pipeline never fills, so the bubble stays lesson 01's."""
    return [[Action(kind, i, r) for i in range(microbatches) for kind in "FI"] for r in range(num_ranks)]


test_exercise, test_the_judge_rejects_a_blank_and_a_wrong_answer = exercise_tests(
    LESSON,
    NAME,
    check,
    wrong=Answer(Path(__file__), "one_at_a_time"),
    wrong_claim=r"the bubble counted in the grid is \(P-1\)/\(M\+P-1\)",
)
