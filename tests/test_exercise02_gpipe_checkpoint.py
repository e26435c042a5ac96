"""Exercise 02: the GPipe schedule, judged on 3 ranks by running it: the answer's lists are executed by
the pipeline runner and the lesson's claims are checked: every rank's order is a valid schedule; the
gradients and parameters equal the unsplit model's on the whole batch (float64, rtol 1e-10; N = 7 rows in
M = 4 micro-batches, uneven); the bubble counted in the schedule's grid is (P-1)/(M+P-1); and every rank
holds all M micro-batches at once, measured while running. (That checkpointing then holds fewer activation
bytes is a claim about the runner, whatever the schedule: tests/test_lesson02_gpipe.py checks it.)"""

from pathlib import Path

from exercise_kit import Exercise
from exercise_schedules import ONE_AT_A_TIME, Rules, departure, trains_exact
from exercise_signatures import Equals, Mistake, Says

from distlab.model_split.schedules import Action, gpipe, one_f_one_b
from distlab.model_split.simulator import simulate
from distlab.model_split.training import PipelineConfig

LESSON, NAME = "gpipe_checkpoint", "gpipe"
P, M = 3, 4
CFG = PipelineConfig(
    widths=(4, *[6] * 11, 3), global_batch=7, micro_batches=M, steps=2, lr=0.2, seed=3, gather_spans=False
)
ONE_F_ONE_B = "min(M, P - r), 1F1B's count"
RULES = Rules(
    "F and I once per micro-batch", "rank r's list holds Action(kind, i, r) for every micro-batch i, I_i after F_i"
)


def _ranks(rt, gpipe_of, claims) -> None:
    schedule = gpipe_of(P, M)
    run = trains_exact(rt, claims, schedule, CFG, RULES, reference=gpipe(P, M))
    if run is None:
        return
    where = departure(schedule, gpipe(P, M), M)  # a valid order that is not GPipe's: where it leaves it
    claims.equal(
        "the bubble counted in the grid is (P-1)/(M+P-1)",
        simulate(schedule).bubble_fraction(),
        (P - 1) / (M + P - 1),
        ok=abs(simulate(schedule).bubble_fraction() - (P - 1) / (M + P - 1)) < 1e-12,
        what="the bubble",
        alternatives={ONE_AT_A_TIME: (P - 1) / P},
        note=where,
    )
    claims.equal(
        "every rank holds all M micro-batches at once",
        run.peak_in_flight,
        M,
        what="micro-batches held at once",
        alternatives={ONE_F_ONE_B: min(M, P - rt.rank), "1, one micro-batch at a time": 1},
        note=where,
    )


MISTAKES = (
    Mistake(
        "one micro-batch at a time",
        "bubble",
        (Equals(ONE_AT_A_TIME),),
        (
            "the bubble is lesson 01's: the pipeline never fills",
            "stage p must forward micro-batch i while stage p + 1 forwards i - 1: no backward before the forwards",
            "every F_i in order, then every I_i: [Action(k, i, r) for k in 'FI' for i in range(M)]",
        ),
    ),
    Mistake(
        "1F1B's order, not GPipe's",
        "holds all M",
        (Equals(ONE_F_ONE_B),),
        (
            "your schedule frees micro-batches early: that is the next lesson's schedule, not GPipe",
            "GPipe runs every forward before any backward, so each rank holds all M at once",
            "all M forwards, then all M backwards, on every rank alike",
        ),
        holds=("bubble",),
    ),
    Mistake(
        "a backward before its forward",
        "is a schedule",
        (Says("deadlocks"),),
        (
            "a backward needs its forward's activations and the gradient from the next stage",
            "on every rank, F_i comes before I_i",
            "the kinds in the order 'FI', not 'IF'",
        ),
    ),
    Mistake(
        "P and M swapped",
        "is a schedule",
        (Says(r"lists for \d+ ranks"),),
        (
            "count your lists: one per rank",
            "gpipe(num_ranks, microbatches): P lists, each over M micro-batches",
            "the outer loop over range(num_ranks), the inner over range(microbatches)",
        ),
    ),
    Mistake(
        "every rank's actions on stage 0",
        "is a schedule",
        (Says("appears twice"),),
        (
            "an action names its stage: rank r runs stage r",
            "Action(kind, microbatch, stage) with stage = the rank's index",
            "Action(kind, i, r) in rank r's list",
        ),
    ),
    Mistake(
        "the stages numbered from the other end",
        "is a schedule",
        (Says("runs stage"),),
        (
            "an action names its stage, and rank r runs stage r: the first layers live on rank 0",
            "the order is a valid pipeline, but on the wrong ranks: list r must hold stage r's actions",
            "Action(kind, i, r) in rank r's list, r counted from 0 at the input",
        ),
    ),
)


def one_at_a_time(num_ranks: int, microbatches: int):
    """Each micro-batch down and back before the next (F_0 I_0 F_1 I_1 ...): exact gradients, the bubble of
    lesson 01."""
    return [[Action(kind, i, r) for i in range(microbatches) for kind in "FI"] for r in range(num_ranks)]


def one_f_one_b_order(num_ranks: int, microbatches: int):
    """Lesson 03's order: exact gradients and GPipe's bubble, but micro-batches freed early."""
    return one_f_one_b(num_ranks, microbatches)


def backward_first(num_ranks: int, microbatches: int):
    """Every backward listed before the forwards."""
    return [[Action(kind, i, r) for kind in "IF" for i in range(microbatches)] for r in range(num_ranks)]


def swapped_arguments(num_ranks: int, microbatches: int):
    """M lists over P micro-batches."""
    return [[Action(kind, i, r) for kind in "FI" for i in range(num_ranks)] for r in range(microbatches)]


def stages_reversed(num_ranks: int, microbatches: int):
    """Rank r running stage P - 1 - r: a valid pipeline, every stage on the wrong rank."""
    return [
        [Action(kind, i, num_ranks - 1 - r) for kind in "FI" for i in range(microbatches)] for r in range(num_ranks)
    ]


def all_on_stage_zero(num_ranks: int, microbatches: int):
    """Every rank's actions on stage 0."""
    return [[Action(kind, i, 0) for kind in "FI" for i in range(microbatches)] for _ in range(num_ranks)]


# World sizes: P = 3 only: the bubble (P-1)/(M+P-1) and M held read the same at any P, and M = 4 != P keeps P and M
# apart.
EXERCISE = Exercise(
    LESSON,
    NAME,
    _ranks,
    P,
    MISTAKES,
    hints=(
        "fill the pipeline: no stage should wait for a micro-batch to come back before sending the next",
        "every rank runs all M forwards first, then all M backwards, first in first out",
        "[[Action(kind, i, r) for kind in 'FI' for i in range(M)] for r in range(P)]",
    ),
    numbers="is a schedule|equal the unsplit",
    quantities=lambda p: {"M": M},
)
WRONG = {
    "one micro-batch at a time": "one_at_a_time",
    "1F1B's order, not GPipe's": "one_f_one_b_order",
    "a backward before its forward": "backward_first",
    "P and M swapped": "swapped_arguments",
    "every rank's actions on stage 0": "all_on_stage_zero",
    "the stages numbered from the other end": "stages_reversed",
}
test_exercise, test_the_blank_is_not_written_yet, test_the_judge_names_the_mistake = EXERCISE.tests(
    Path(__file__), WRONG
)
test_the_judge_checks_beyond_numbers = EXERCISE.structure_test(
    Path(__file__), {"one_at_a_time": "bubble", "one_f_one_b_order": "holds all M"}
)

test_the_judge_rejects_a_planted_slip = EXERCISE.audit_test(Path(__file__))
test_the_judge_rejects_a_second_slip = EXERCISE.audit_test(Path(__file__), second=True)
