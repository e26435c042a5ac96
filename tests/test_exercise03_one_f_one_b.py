"""Exercise 03: the 1F1B schedule, judged on 3 ranks by running it: the answer's lists are executed by the
pipeline runner, and the lesson's claims are checked: every rank's order is a valid schedule, the gradients
and parameters equal the unsplit model's on the whole batch (float64, rtol 1e-10), and rank r holds at most
min(M, P - r) micro-batches at once, measured while running, for M < P and M > P."""

from pathlib import Path

from exercise_kit import Answer, exercise_tests, judge

from distlab.compare import all_ok, compare
from distlab.pipeline.runner import PipelineStep
from distlab.pipeline.schedules import check_schedule, gpipe
from distlab.pipeline.simulator import simulate
from distlab.pipeline.training import PipelineConfig, train, unsplit_reference

LESSON, NAME = "03_one_f_one_b", "one_f_one_b"
P = 3
CFG = PipelineConfig(widths=(4, *[6] * 5, 3), global_batch=10, steps=2, lr=0.2, seed=3, gather_spans=False)


def _ranks(rt, one_f_one_b, claims) -> None:
    for m in (2, 5):  # M < P: no steady state on the first ranks; M > P: warm-up, alternation, drain
        schedule, why = one_f_one_b(P, m), f"not {P} ranks' lists"
        try:  # check_schedule: F and I once per micro-batch and stage; simulate: no deadlock
            ok = len(schedule) == P and check_schedule(schedule) == m and simulate(schedule).ticks > 0
        except ValueError as err:
            ok, why = False, str(err)
        if not claims.check(
            f"M={m}: every rank's order is a schedule (F and I once per micro-batch, no deadlock)",
            ok,
            "" if ok else why,
            "rank r's actions are Action(kind, i, r); a backward I_i after its forward F_i",
        ):
            return
        cfg = CFG.replace(micro_batches=m)
        run, ref = train(rt, cfg, PipelineStep(rt, cfg, schedule)), unsplit_reference(cfg)
        exact = all_ok(compare({n: ref.first_grads[n] for n in run.first_grads}, run.first_grads)) and all_ok(
            compare({n: ref.params[n] for n in run.params}, run.params)
        )
        claims.check(
            f"M={m}: the gradients and parameters equal the unsplit model's",
            exact,
            "",
            "every micro-batch must run its F and I exactly once",
        )
        held, most = run.peak_in_flight, min(m, P - rt.rank)
        claims.check(
            f"M={m}: rank r holds at most min(M, P - r) micro-batches",
            held <= most,
            f"rank {rt.rank} held {held}, at most {most}",
            "start the backwards after min(P - r - 1, M) warm-up forwards, then alternate",
        )


def check(answer: Answer) -> None:
    judge(_ranks, P, answer)


# A wrong answer: GPipe's order (lesson 02's), right gradients but all M micro-batches held at once.
gpipe_order = gpipe


test_exercise, test_the_judge_rejects_a_blank_and_a_wrong_answer = exercise_tests(
    LESSON, NAME, check, wrong=Answer(Path(__file__), "gpipe_order"), wrong_claim="rank r holds at most"
)
