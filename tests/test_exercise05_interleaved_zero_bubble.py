"""Exercise 05: the zero-bubble schedule ZB-H1, judged on 3 ranks by running it: the answer's lists are
executed by the pipeline runner (I and W split: the input's gradient first, the weights' later), and the
lesson's claims are checked: every rank's order is a valid schedule with every backward split into I and
W; the gradients and parameters equal the unsplit model's on the whole batch (float64, rtol 1e-10); the
bubble counted in the schedule's grid is (P-1)/(3M+P-1); and rank r holds min(M, P) micro-batches,
measured while running (M = 4 > P). The lists at two more M are judged as data, without a run: M = 5 (not a
multiple of P) and M = 1 (fewer micro-batches than rank 0's P - r - 1 warm-up forwards, where the warm-up's cap at M
bites and the bubble formula no longer holds): each is a schedule, rank r's order holds min(M, P) micro-batches, and
the bubble is (P-1)/(3M+P-1) at M = 5. Beside the claims, where the answer's order differs from the lesson's at
that M: each rank's forwards before its first I and W's held back, and where its list first leaves the lesson's."""

from collections import deque
from pathlib import Path

from exercise_kit import Exercise
from exercise_schedules import Rules, departure, trains_exact, why_invalid
from exercise_signatures import Equals, Mistake, Says

from distlab.model_split.schedules import Action, one_f_one_b, zero_bubble
from distlab.model_split.simulator import peak_in_flight, simulate
from distlab.model_split.training import PipelineConfig

LESSON, NAME = "interleaved_zero_bubble", "zb_h1"
P, M, OTHER_M = 3, 4, (5, 1)
CFG = PipelineConfig(
    widths=(4, *[6] * 5, 3), global_batch=8, micro_batches=M, steps=2, lr=0.2, seed=3, gather_spans=False
)
NONE_HELD = "min(M, P - r), 1F1B's count: no W held back"
ALL_HELD = "M: every W held back to the end"
WRONG_RANKS = "min(M, 2P - 1 - 2r): P - 1 - r W's held back instead of r"
ONE_FEWER = "min(M, P - 1) past rank 0: r - 1 W's held back, one too few"
RULES = Rules(
    "F, I and W once per micro-batch",
    "rank r's list holds Action(kind, i, r) for every micro-batch i: W_i after I_i after F_i",
    split=True,
)


def _held(m: int, r: int) -> dict[str, int]:
    """What each catalogued misreading holds on rank r at M = m."""
    return {
        NONE_HELD: min(m, P - r),
        ALL_HELD: m,
        WRONG_RANKS: min(m, 2 * P - 1 - 2 * r),
        ONE_FEWER: min(m, P - (r > 0)),
    }


def _counted(actions) -> tuple[int, int]:
    """(the forwards before the first I, the most W's still waiting when an F or an I runs) in one rank's list."""
    kinds = [getattr(a, "kind", None) for a in actions]
    forwards = kinds.index("I") if "I" in kinds else kinds.count("F")
    waiting = most = 0
    for kind in kinds:
        most = max(most, waiting) if kind in ("F", "I") else most
        waiting += (kind == "I") - (kind == "W")
    return forwards, most


def _compared(schedule, m: int) -> str:
    """What the answer's order did differently from the lesson's at M = m, "" when nothing: each rank's forwards
    before its first I (the warm-up) and W's held back, where they differ, then where a rank's list first leaves
    the lesson's order. A description beside the claims, never a claim: another valid order is no mistake."""
    lesson = zero_bubble(P, m)
    try:
        got, want = [_counted(a) for a in schedule], [_counted(a) for a in lesson]
    except (TypeError, AttributeError):
        return ""
    said = [
        f"{words} {', '.join(str(c[i]) for c in got)} (the lesson's {', '.join(str(c[i]) for c in want)})"
        for i, words in enumerate(("forwards before the first I", "the W's waiting at most when an F or I runs"))
        if len(got) == len(want) and [c[i] for c in got] != [c[i] for c in want]
    ]
    where = departure(schedule, lesson, m)
    return "; ".join(([f"at M = {m}, per rank: " + "; ".join(said)] if said else []) + ([where] if where else []))


def _as_data(rt, zb_h1, claims, m: int) -> None:
    """The lists at another M, judged as data: a schedule, what rank r holds (counted in its order), the bubble."""
    schedule = zb_h1(P, m)
    why, apart = why_invalid(schedule, P, m, split=True), _compared(schedule, m)
    claim = f"M={m}: every rank's order is a schedule ({RULES.words}, no deadlock)"
    note = "; ".join(filter(None, (why, apart)))
    if not claims.holds(claim, not why, what="the schedule", note=note, hints=(RULES.how,)):
        return
    claims.equal(
        f"M={m}: rank r holds min(M, P) micro-batches (counted in its order)",
        peak_in_flight(schedule)[rt.rank],
        min(m, P),
        what="micro-batches held at once",
        alternatives=_held(m, rt.rank),
        hints=("the W's held back are capped by the micro-batches there are: min(M, r)",),
        note=apart,
    )
    if m >= P:  # below P the grid has idle ticks no W can fill
        bubble, formula = simulate(schedule).bubble_fraction(), (P - 1) / (3 * m + P - 1)
        ok = abs(bubble - formula) < 1e-12
        claims.equal(f"M={m}: the bubble is (P-1)/(3M+P-1)", bubble, formula, ok=ok, what="the bubble", note=apart)


def _ranks(rt, zb_h1, claims) -> None:
    schedule = zb_h1(P, M)
    run = trains_exact(rt, claims, schedule, CFG, RULES, reference=zero_bubble(P, M))
    if run is None:
        return
    apart = _compared(schedule, M)  # beside the claims below, never a claim: another valid order is no mistake
    bubble, formula = simulate(schedule).bubble_fraction(), (P - 1) / (3 * M + P - 1)
    claims.equal(
        "the bubble counted in the grid is (P-1)/(3M+P-1)",
        bubble,
        formula,
        ok=abs(bubble - formula) < 1e-12,
        what="the bubble",
        hints=("the W's a rank holds back fill the ticks where it would wait for a gradient",),
        note=apart,
    )
    claims.equal(
        "rank r holds min(M, P) micro-batches",
        run.peak_in_flight,
        min(M, P),
        what="micro-batches held at once",
        alternatives=_held(M, rt.rank),
        note=apart,
    )
    for m in OTHER_M:
        _as_data(rt, zb_h1, claims, m)


MISTAKES = (
    Mistake(
        "no W held back",
        "holds min",
        (Equals(NONE_HELD),),
        (
            "each W runs right after its I: nothing is left to fill 1F1B's idle ticks",
            "rank r keeps its last r W's waiting; the oldest runs only once more than r wait",
            "after each I: waiting.append(W); if len(waiting) > r: order.append(waiting.popleft())",
        ),
    ),
    Mistake(
        "every W held back to the end",
        "holds min",
        (Equals(ALL_HELD),),
        (
            "holding back every W keeps every micro-batch's activations until the end",
            "rank r holds back only r W's: the oldest runs as soon as more than r are waiting",
            "pop the oldest waiting W when len(waiting) > r, and append the rest at the end",
        ),
        fails=("bubble",),
    ),
    Mistake(
        "the W's held back on the wrong ranks",
        "holds min",
        (Equals(WRONG_RANKS),),
        (
            "rank 0 holds back the most W's, where it should hold back none",
            "the last ranks wait longest for gradients in 1F1B: rank r holds back r W's",
            "len(waiting) > r, not len(waiting) > P - 1 - r",
        ),
    ),
    Mistake(
        "one W too few held back",
        "holds min",
        (Equals(ONE_FEWER),),
        (
            "each rank past the first holds back one W fewer than it can: the bubble is larger than ZB-H1's",
            "rank r keeps r W's waiting: the oldest runs only once more than r wait (r + 1 in the queue)",
            "pop the oldest when len(waiting) > r, not when len(waiting) >= r",
        ),
        fails=("bubble",),
    ),
    Mistake(
        "a W before its I",
        "is a schedule",
        (Says(r"deadlocks:.* at \d+W\d"),),  # a rank stuck at a W: its I had not run
        (
            "a weight gradient needs the output gradient its I received",
            "on every rank W_i comes after I_i, which comes after F_i",
            "append Action('W', i, r) to the waiting queue after appending Action('I', i, r)",
        ),
    ),
    Mistake(
        "the backward never split",
        "is a schedule",
        (Says("no backward has a W"),),  # none split: "some backward has no W" is another slip
        (
            "zero bubble needs the weights' gradient as an action of its own",
            "split each backward into I (the input's gradient, which rank r - 1 waits for) and W (the weights')",
            "Action('W', i, r) for every I_i",
        ),
    ),
)


def _held_back(num_ranks: int, microbatches: int, keep) -> list:
    """1F1B's order with every backward split, rank r holding back keep(r) W's (None: all of them)."""
    schedule = []
    for r in range(num_ranks):
        warmup = min(num_ranks - r - 1, microbatches)
        order, waiting = [Action("F", i, r) for i in range(warmup)], deque()
        for i in range(microbatches):
            if warmup + i < microbatches:
                order.append(Action("F", warmup + i, r))
            order.append(Action("I", i, r))
            waiting.append(Action("W", i, r))
            if keep(r) is not None and len(waiting) > keep(r):
                order.append(waiting.popleft())
        schedule.append(order + list(waiting))
    return schedule


def w_right_after_i(num_ranks: int, microbatches: int):
    """1F1B with every backward split but no W held back: exact gradients, 1F1B's bubble."""
    return _held_back(num_ranks, microbatches, lambda r: 0)


def all_w_at_the_end(num_ranks: int, microbatches: int):
    """Every W held back until the rank's last I."""
    return _held_back(num_ranks, microbatches, lambda r: None)


def held_back_on_wrong_ranks(num_ranks: int, microbatches: int):
    """Rank r holds back P - 1 - r W's."""
    return _held_back(num_ranks, microbatches, lambda r: num_ranks - 1 - r)


def w_before_i(num_ranks: int, microbatches: int):
    """ZB-H1's order with each W listed where its I should be, and the I where the W was."""
    swap = {"I": "W", "W": "I", "F": "F"}
    return [
        [Action(swap[a.kind], a.microbatch, a.stage) for a in order]
        for order in _held_back(num_ranks, microbatches, lambda r: r)
    ]


def unsplit(num_ranks: int, microbatches: int):
    """1F1B itself: no W anywhere."""
    return one_f_one_b(num_ranks, microbatches)


def one_w_too_few_held(num_ranks: int, microbatches: int):
    """Rank r holds back r - 1 W's (none on rank 0)."""
    return _held_back(num_ranks, microbatches, lambda r: max(r - 1, 0))


def one_w_too_many_held(num_ranks: int, microbatches: int):
    """Right numbers and the formula's bubble, but r + 1 W's held back: every micro-batch held at once."""
    return _held_back(num_ranks, microbatches, lambda r: r + 1)


# World sizes: P = 3 only: rank r holds r W's, so ranks 0, 1, 2 already show none, one and two held back (M = 4 > P);
# M = 5 and M = 1 as data (a remainder, and the warm-up's cap at M, which bites only where M < P - 1).
EXERCISE = Exercise(
    LESSON,
    NAME,
    _ranks,
    P,
    MISTAKES,
    hints=(
        "the weights' gradient is wanted by no one: run it where 1F1B would idle",
        "1F1B's order with each backward split in I and W; rank r keeps r W's waiting and runs the rest at the end",
        "after each I_i: waiting.append(W_i); if len(waiting) > r: order.append(waiting.popleft()); "
        "at the end: order += waiting",
    ),
    numbers="is a schedule|equal the unsplit",
    quantities=lambda p: {"M": M},
)
WRONG = {
    "no W held back": "w_right_after_i",
    "every W held back to the end": "all_w_at_the_end",
    "the W's held back on the wrong ranks": "held_back_on_wrong_ranks",
    "one W too few held back": "one_w_too_few_held",
    "a W before its I": "w_before_i",
    "the backward never split": "unsplit",
}
test_exercise, test_the_blank_is_not_written_yet, test_the_judge_names_the_mistake = EXERCISE.tests(
    Path(__file__), WRONG
)
test_the_judge_checks_beyond_numbers = EXERCISE.structure_test(
    Path(__file__), {"w_right_after_i": "bubble", "one_w_too_many_held": "holds min"}
)

test_the_judge_rejects_a_planted_slip = EXERCISE.audit_test(Path(__file__))
test_the_judge_rejects_a_second_slip = EXERCISE.audit_test(Path(__file__), second=True)
