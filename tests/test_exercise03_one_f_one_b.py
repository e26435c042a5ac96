"""Exercise 03: the 1F1B schedule, judged on 3 ranks by running it: the answer's lists are executed by the
pipeline runner, and the lesson's claims are checked for M > P and M < P: every rank's order is a valid
schedule; the gradients and parameters equal the unsplit model's on the whole batch (float64, rtol 1e-10);
rank r holds at most min(M, P - r) micro-batches at once, measured while running; and the bubble counted in
the schedule's grid is GPipe's, (P-1)/(M+P-1): 1F1B saves memory, not time. At P = 3 every M >= P - 1 leaves the
warm-up's cap min(P - r - 1, M) a no-op, so the schedule is also judged as data at P = 4, M = 2 (validity, the
held count and the bubble by the simulator, no processes): a warm-up left uncapped fails there."""

from pathlib import Path

from exercise_kit import Exercise
from exercise_schedules import ONE_AT_A_TIME, Rules, departure, trains_exact, why_invalid
from exercise_signatures import Equals, Mistake, Says

from distlab.model_split.schedules import Action, gpipe, one_f_one_b
from distlab.model_split.simulator import peak_in_flight, simulate
from distlab.model_split.training import PipelineConfig

LESSON, NAME = "one_f_one_b", "one_f_one_b"
P, BIG, FEW = 3, 4, 2  # trained at P = 3; at P = 4 with M = 2 < P - 1, judged as data
CFG = PipelineConfig(widths=(4, *[6] * 5, 3), global_batch=10, steps=2, lr=0.2, seed=3, gather_spans=False)
GPIPE, ONE_MORE = "M, all of them (GPipe's count)", "min(M, P - r + 1): one warm-up forward too many"
RULES = Rules(
    "F and I once per micro-batch", "rank r's list holds Action(kind, i, r) for every micro-batch i, I_i after F_i"
)


def _as_data(one_f_one_b_of, claims) -> None:
    """At P = 4 with M = 2 < P - 1, the schedule as data (the simulator's grid, no processes): the warm-up's cap
    min(P - r - 1, M) bites there, where at P = 3 every M >= P - 1 leaves it a no-op."""
    schedule, lesson = one_f_one_b_of(BIG, FEW), one_f_one_b(BIG, FEW)
    why = why_invalid(schedule, BIG, FEW)
    where = departure(schedule, lesson, FEW)  # where the lists leave the lesson's order, said beside the claims
    if not claims.holds(
        f"P={BIG}, M={FEW}: every rank's order is a schedule (fewer micro-batches than stages ahead)",
        not why,
        what="the schedule",
        note=f"{why}; {where}" if why and where else why,
        hints=(
            "with fewer micro-batches than stages ahead of it, a rank cannot warm up with P - r - 1 forwards",
            "the warm-up is min(P - r - 1, M): at P = 4, M = 2, rank 0 runs both forwards, then both backwards",
        ),
    ):
        return
    held, bubble = peak_in_flight(schedule), simulate(schedule).bubble_fraction()
    claims.equal(
        f"P={BIG}, M={FEW}: the held counts and the bubble are 1F1B's, min(M, P - r) and (P-1)/(M+P-1)",
        (held, round(bubble, 12)),
        ([min(FEW, BIG - r) for r in range(BIG)], round((BIG - 1) / (FEW + BIG - 1), 12)),
        ok=all(h <= min(FEW, BIG - r) for r, h in enumerate(held))
        and abs(bubble - (BIG - 1) / (FEW + BIG - 1)) < 1e-12,
        what="(held per rank, bubble)",
        note=where,
    )


def _ranks(rt, one_f_one_b_of, claims) -> None:
    _as_data(one_f_one_b_of, claims)
    for m in (5, 2):  # M > P: warm-up, alternation, drain; M < P: no steady state on the first ranks
        schedule, cfg, lesson = one_f_one_b_of(P, m), CFG.replace(micro_batches=m), one_f_one_b(P, m)
        run = trains_exact(rt, claims, schedule, cfg, RULES, prefix=f"M={m}: ", reference=lesson)
        if run is None:
            return
        where = departure(schedule, lesson, m)
        held, most = run.peak_in_flight, min(m, P - rt.rank)
        claims.equal(
            f"M={m}: rank r holds at most min(M, P - r) micro-batches",
            held,
            most,
            ok=held <= most,
            what="micro-batches held at once",
            alternatives={GPIPE: m, ONE_MORE: min(m, P - rt.rank + 1)},
            note=where,
        )
        bubble, formula = simulate(schedule).bubble_fraction(), (P - 1) / (m + P - 1)
        claims.equal(
            f"M={m}: the bubble counted in the grid is GPipe's, (P-1)/(M+P-1)",
            bubble,
            formula,
            ok=abs(bubble - formula) < 1e-12,
            what="the bubble",
            alternatives={ONE_AT_A_TIME: (P - 1) / P},
            note=where,
            hints=(
                "1F1B reorders the work but idles exactly as GPipe does: a larger bubble is a rank waiting "
                "for a micro-batch it could have had",
                "count the idle slots in the grid (distlab.model_split.simulator.simulate): each rank should idle "
                "P - 1 slots in all, at the start and at the end, none in the steady state",
                "warm up with min(P - r - 1, M) forwards, then F and I in turn, then the remaining I's",
            ),
        )


MISTAKES = (
    Mistake(
        "GPipe's order",
        "M=5: rank r holds",
        (Equals(GPIPE),),
        (
            "every rank holds all M micro-batches: no backward starts before the last forward",
            "a backward frees its micro-batch: start them as soon as the pipeline is full, then alternate",
            "warm up with min(P - r - 1, M) forwards, then F and I in turn, then the remaining I's",
        ),
    ),
    Mistake(
        "one warm-up forward too many",
        "M=5: rank r holds",
        (Equals(ONE_MORE),),
        (
            "each rank holds exactly one micro-batch more than it needs",
            "rank r's first backward can start once P - r - 1 forwards are ahead of it in the pipeline",
            "warmup = min(P - r - 1, M), not min(P - r, M)",
        ),
    ),
    Mistake(
        "no warm-up",
        "bubble",
        (Equals(ONE_AT_A_TIME),),
        (
            "the memory is fine, but the bubble is lesson 01's: the pipeline never fills",
            "rank r must run min(P - r - 1, M) forwards before its first backward",
            "order = [F(i) for i in range(warmup)], then F(warmup + k), I(k) in turn",
        ),
        holds=("holds at most",),
    ),
    Mistake(
        "the warm-ups on the wrong ranks",
        "is a schedule",
        (Says("deadlocks"),),
        (
            "a rank waits for a gradient that never comes: its warm-up is out of step with its neighbours'",
            "the first stage warms up longest (P - 1 forwards), the last not at all",
            "warmup = min(P - r - 1, M): P - 1 on rank 0, 0 on rank P - 1",
        ),
    ),
)


def _warmed(num_ranks: int, microbatches: int, warmup) -> list:
    """1F1B's three phases with rank r warming up with warmup(r) forwards (at most M)."""
    schedule = []
    for r in range(num_ranks):
        w = min(warmup(r), microbatches)
        order = [Action("F", i, r) for i in range(w)]
        for k in range(microbatches - w):
            order += [Action("F", w + k, r), Action("I", k, r)]
        schedule.append(order + [Action("I", i, r) for i in range(microbatches - w, microbatches)])
    return schedule


def gpipe_order(num_ranks: int, microbatches: int):
    """GPipe's order (lesson 02's): right gradients, all M micro-batches held at once."""
    return gpipe(num_ranks, microbatches)


def one_forward_too_many(num_ranks: int, microbatches: int):
    """Warm-up with min(P - r, M) forwards."""
    return _warmed(num_ranks, microbatches, lambda r: num_ranks - r)


def no_warm_up(num_ranks: int, microbatches: int):
    """F_i, I_i in turn from the start on every rank: little memory, the bubble of lesson 01."""
    return _warmed(num_ranks, microbatches, lambda r: 0)


def warm_ups_reversed(num_ranks: int, microbatches: int):
    """Rank r warms up with r forwards: rank 0 waits for a gradient before anyone has its input."""
    return _warmed(num_ranks, microbatches, lambda r: r)


# World sizes: P = 3 trained, and P = 4 with M = 2 as data (_as_data): the warm-up's cap min(P - r - 1, M) is a no-op
# at P = 3.
EXERCISE = Exercise(
    LESSON,
    NAME,
    _ranks,
    P,
    MISTAKES,
    hints=(
        "start each micro-batch's backward as early as the pipeline allows: its activations go with it",
        "rank r warms up with min(P - r - 1, M) forwards, then one forward and one backward in turn, then the "
        "remaining backwards",
        "order = [F(i) for i in range(w)]; for k in range(M - w): order += [F(w + k), I(k)]; then I(M - w) .. I(M - 1)",
    ),
    numbers="is a schedule|equal the unsplit",
)
WRONG = {
    "GPipe's order": "gpipe_order",
    "one warm-up forward too many": "one_forward_too_many",
    "no warm-up": "no_warm_up",
    "the warm-ups on the wrong ranks": "warm_ups_reversed",
}
test_exercise, test_the_blank_is_not_written_yet, test_the_judge_names_the_mistake = EXERCISE.tests(
    Path(__file__), WRONG
)
test_the_judge_checks_beyond_numbers = EXERCISE.structure_test(
    Path(__file__), {"gpipe_order": "holds at most", "no_warm_up": "bubble"}
)

test_the_judge_rejects_a_planted_slip = EXERCISE.audit_test(Path(__file__))
test_the_judge_rejects_a_second_slip = EXERCISE.audit_test(Path(__file__), second=True)
