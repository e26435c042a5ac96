"""Exercise 19: DualPipeV as data, judged on 2 ranks by running it: the answer's units, flattened (a pair as its
forward, then its backward), are executed by the pipeline runner, and the lesson's claims are checked: every
rank's order is a schedule; the gradients and parameters equal the unsplit model's (float64); the grid's bubble
is (P-1)/(6M+P-1); every rank holds 2P + 1 half-stage activations at its peak; the steady state runs its
(forward, backward) pairs; torch's ScheduleDualPipeV plans the same order."""

from pathlib import Path

from exercise_kit import Exercise
from exercise_schedules import Rules, departure, tally, trains_exact
from exercise_signatures import Equals, Mistake, Zero
from helpers import load_lesson

from distlab.model_split.schedules import zbv
from distlab.model_split.simulator import peak_in_flight, simulate
from distlab.model_split.torch_engine import TorchStep
from distlab.model_split.training import PipelineConfig

LESSON, NAME = "dualpipe", "dualpipev"
P, M = 2, 6
CFG = PipelineConfig(
    widths=(4, *[6] * 4, 3), global_batch=12, micro_batches=M, steps=1, lr=0.2, seed=3, gather_spans=False
)
CFG = CFG.replace(schedule="dualpipev", stages_per_rank=2)
BACKWARD_FIRST = "2P, the pairs run backward first"
WORDS, HOW = (
    "F and I once per micro-batch and stage, W after I",
    "each unit is a tuple of Actions, stage a = r and b = 2P - 1 - r, each run once per micro-batch: stage a's "
    "forwards add up to M as 2 (P - r - 1) down the V, r + 1 at the turn, then one per steady-state pair",
)


def _v(rank: int) -> set[int]:
    """The V: rank r holds stages r and 2P - 1 - r."""
    return {rank, 2 * P - 1 - rank}


def _flat(ticks):
    return [[a for unit in order for a in unit] for order in ticks]


def _ranks(rt, dualpipev, claims) -> None:
    ticks = dualpipev(P, M)
    schedule, lesson = _flat(ticks), _flat(_solution().dualpipev(P, M))
    run = trains_exact(rt, claims, schedule, CFG, Rules(WORDS, HOW, stages_of=_v), reference=lesson)
    if run is None:
        return
    # where the order leaves the lesson's, beside the claims it moves (a description, never a claim of its own)
    note = "; ".join(filter(None, (departure(schedule, lesson, M), tally(schedule, lesson))))
    bubble, formula = simulate(schedule).bubble_fraction(), (P - 1) / (6 * M + P - 1)
    claims.equal(
        "the bubble counted in the grid is (P-1)/(6M+P-1)",
        bubble,
        formula,
        ok=abs(bubble - formula) < 1e-12,
        what="the bubble",
        note=note,
    )
    claims.equal(
        "rank r holds 2P + 1 activations",
        peak_in_flight(schedule)[rt.rank],
        2 * P + 1,
        what="half-stage activations held at once",
        alternatives={BACKWARD_FIRST: 2 * P, "ZB-V's 2P": peak_in_flight(zbv(P, M))[rt.rank]},
        note=note,
    )
    r = rt.rank
    pairs = sum(len(unit) == 2 for unit in ticks[r])
    claims.equal(
        "the steady state runs its pairs",
        pairs,
        2 * (M - 2 * P + r + 1) - (r == P - 1) + (P - r - 1),
        what="(forward, backward) pairs on this rank",
        note=note,
    )
    planned = TorchStep(rt, CFG).planned
    claims.holds("torch's ScheduleDualPipeV plans this order", planned == schedule[r], what="rank r's order")


MISTAKES = (
    Mistake(
        "the pairs run backward first",
        "holds 2P",
        (Equals(BACKWARD_FIRST),),
        (
            "a pair is (forward, backward): the forward's activations are held while the backward releases its own",
            "write each pair as (F, B), the forward first, as torch's OVERLAP_F_B does",
            "me.add(F(a), B(b)), not me.add(B(b), F(a))",
        ),
    ),
    Mistake(
        "no pairs: every unit alone",
        "runs its pairs",
        (Zero(),),
        (
            "the order is right, but the overlap is not in the data: each pair is two units",
            "phases 4 and 5 put one forward and one backward in a single tuple",
            "ticks.append((forward, backward))",
        ),
    ),
)


def _solution():
    return load_lesson("dualpipe")


def backward_first(num_ranks, microbatches):
    """Each pair (B, F)."""
    return [[tuple(reversed(u)) for u in order] for order in _solution().dualpipev(num_ranks, microbatches)]


def unpaired(num_ranks, microbatches):
    """The right order, every action its own unit."""
    return [[(a,) for u in order for a in u] for order in _solution().dualpipev(num_ranks, microbatches)]


# World sizes: P = 2 only: DualPipeV needs M >= 2P; the V's claims (2P + 1 held, the pairs per rank) are read in P and
# r already.
EXERCISE = Exercise(
    LESSON,
    NAME,
    _ranks,
    P,
    MISTAKES,
    hints=(
        "the V of ZB-V, with the steady state's forward of one stage and backward of the other run as one unit",
        "keep a counter per (kind, stage) for the next micro-batch, and a queue of held-back W's; then the eight "
        "phases one after another",
        "phase 4: for k in range(M - 2P + r + 1): add (F(a), B(b)) (two units on rank P - 1 at k = 0), "
        "then (F(b), B(a))",
    ),
    numbers="is a schedule|equal the unsplit",
)
WRONG = {"the pairs run backward first": "backward_first", "no pairs: every unit alone": "unpaired"}
test_exercise, test_the_blank_is_not_written_yet, test_the_judge_names_the_mistake = EXERCISE.tests(
    Path(__file__), WRONG
)

test_the_judge_rejects_a_planted_slip = EXERCISE.audit_test(Path(__file__))
test_the_judge_rejects_a_second_slip = EXERCISE.audit_test(Path(__file__), second=True)
