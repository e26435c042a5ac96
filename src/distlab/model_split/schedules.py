"""Pipeline schedules as data: which rank runs which stage's forward, backward and weight gradient,
in which order. Pure functions; `simulator.py` turns the orders into a grid of ticks.

The model is cut into vP stages (p = 0 .. vP-1), v per rank. A schedule is, per rank r, an ordered
list of actions on micro-batches i = 0 .. M-1:

    F(p, i)  forward of micro-batch i through stage p
    I(p, i)  backward through stage p: the gradient of its input, which stage p - 1 waits for.
             When the schedule has no W(p, i), I(p, i) also computes the weights' gradient (the
             usual, unsplit backward of GPipe and 1F1B).
    W(p, i)  the weights' gradient of stage p for micro-batch i, split off I(p, i) so that it can
             run later, where a rank would otherwise wait (zero-bubble pipelines).

Placement, the stages of rank r: one per rank, p = r (v = 1); looped, r, r + P, .., r + (v-1) P
(interleaved 1F1B, Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
Clusters", arXiv 2104.04473); V-shaped, r and 2P - 1 - r (ZB-V, Qi et al. 2023, "Zero Bubble Pipeline
Parallelism", arXiv 2401.10241), so that the first and last stage share rank 0 and the turn of the V,
stages P - 1 and P, shares rank P - 1: that handoff is local, no message.

The schedules (the orders torch.distributed.pipelining 2.13 executes for the same names; lesson 05):
- `gpipe`: every forward, then every backward, first in first out (any backward order is valid:
  micro-batches are independent; a reverse order is one choice, not a requirement).
- `one_f_one_b`: warm up with min(P - r - 1, M) forwards, then one forward and one backward in
  turn, then the remaining backwards: at most P - r micro-batches held instead of M.
- `interleaved_1f1b` (v >= 2, looped): the same three phases over v M chunk-actions; forwards go
  through the rank's stages in rounds of g micro-batches (g = P when P divides M). Warm-up
  (v - 1) g + 2 (P - r - 1): the forwards that fit before the rank's first backward can arrive.
- `zero_bubble` (v = 1: ZB-H1): 1F1B's order with every backward split into I and W, and rank r
  holding back r W's, which then fill the ticks where 1F1B would wait. v >= 2: the interleaved
  version (torch's ScheduleInterleavedZeroBubble).
- `zbv` (v = 2, V placement): ZB-V, forwards down the V and back up, I and W split.
- `looped_bfs` (looped, breadth first): all forwards of a rank's first stage, then of its next,
  then every backward in reverse (torch's ScheduleLoopedBFS).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

KINDS = ("F", "I", "W")


@dataclass(frozen=True, order=True)
class Action:
    """One unit of work: `kind` F, I or W of micro-batch `microbatch` on stage `stage`."""

    kind: str
    microbatch: int
    stage: int

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"an action is one of {KINDS}, got {self.kind!r}")

    def __str__(self) -> str:  # the micro-batch's view, enough when each rank holds one stage
        return f"{self.kind}{self.microbatch}"

    @property
    def label(self) -> str:
        """'2F0': stage 2, forward, micro-batch 0 (torch.distributed.pipelining's spelling)."""
        return f"{self.stage}{self.kind}{self.microbatch}"


Schedule = list[list[Action]]  # schedule[r] = rank r's actions, in execution order


# --- placement: which stages each rank holds ---------------------------------------------------


def looped(num_ranks: int, stages_per_rank: int) -> list[list[int]]:
    """Rank r holds r, r + P, .., r + (v - 1) P."""
    return [[r + k * num_ranks for k in range(stages_per_rank)] for r in range(num_ranks)]


def v_shape(num_ranks: int) -> list[list[int]]:
    """Rank r holds r and 2P - 1 - r."""
    return [[r, 2 * num_ranks - 1 - r] for r in range(num_ranks)]


def placement(schedule: Schedule) -> list[list[int]]:
    """The stages each rank runs, read off the schedule itself."""
    return [sorted({a.stage for a in order}) for order in schedule]


def num_stages(schedule: Schedule) -> int:
    return 1 + max(a.stage for order in schedule for a in order)


def rank_of(schedule: Schedule) -> dict[int, int]:
    """stage -> the rank that runs it."""
    return {p: r for r, stages in enumerate(placement(schedule)) for p in stages}


def split_backward(schedule: Schedule) -> set[tuple[int, int]]:
    """The (stage, micro-batch) pairs whose backward is split into I and a later W."""
    return {(a.stage, a.microbatch) for order in schedule for a in order if a.kind == "W"}


# --- the schedules -----------------------------------------------------------------------------


def _check(num_ranks: int, microbatches: int, stages_per_rank: int = 1) -> None:
    if num_ranks < 1:
        raise ValueError(f"need at least one rank, got P={num_ranks}")
    if microbatches < 1:
        raise ValueError(f"need at least one micro-batch (--micro-batches), got M={microbatches}")
    if stages_per_rank < 1:
        raise ValueError(f"need at least one stage per rank (--stages-per-rank), got v={stages_per_rank}")


def gpipe(num_ranks: int, microbatches: int) -> Schedule:
    """All forwards, then all backwards, on every rank (one stage per rank)."""
    _check(num_ranks, microbatches)
    return [[Action(kind, i, r) for kind in "FI" for i in range(microbatches)] for r in range(num_ranks)]


def looped_bfs(num_ranks: int, microbatches: int, stages_per_rank: int = 2) -> Schedule:
    """Breadth first: every forward of the rank's first stage, then of its next; backwards in reverse."""
    _check(num_ranks, microbatches, stages_per_rank)
    schedule = []
    for stages in looped(num_ranks, stages_per_rank):
        order = [Action("F", i, p) for p in stages for i in range(microbatches)]
        order += [Action("I", i, p) for p in reversed(stages) for i in reversed(range(microbatches))]
        schedule.append(order)
    return schedule


def round_size(num_ranks: int, microbatches: int) -> int:
    """g: interleaved schedules send micro-batches through a rank's stages in rounds of g. With
    P | M, g = P; otherwise M // (M // P) rounds, which must divide M (torch's rule, kept so that
    our orders and torch's can be compared for every M torch accepts)."""
    rounds = max(1, microbatches // num_ranks)
    if microbatches % rounds:
        raise ValueError(
            f"interleaved schedules run M (--micro-batches) in rounds of equal size: M={microbatches} "
            f"on P={num_ranks} ranks gives {rounds} rounds, which do not divide it; use M < 2P or a "
            f"multiple of P"
        )
    return microbatches // rounds


def _chunks(stages: list[int], microbatches: int, group: int, backward: bool) -> list[tuple[int, int]]:
    """(stage, micro-batch) in the order a rank runs them: a round of `group` micro-batches through
    each of its stages in turn (backwards: the stages in reverse), then the next round."""
    ordered = list(reversed(stages)) if backward else stages
    return [(p, i) for start in range(0, microbatches, group) for p in ordered for i in range(start, start + group)]


def _one_f_one_b_order(
    stages: list[int], microbatches: int, group: int, warmup: int, held_back_w: int | None
) -> list[Action]:
    """Warm-up forwards, then one forward and one backward in turn, then the remaining backwards.
    `held_back_w` None: unsplit backwards. A number h: every backward split into I and W, and W of
    the oldest I runs as soon as more than h are waiting (the zero-bubble rule)."""
    forwards = _chunks(stages, microbatches, group, backward=False)
    backwards = _chunks(stages, microbatches, group, backward=True)
    warmup = min(warmup, len(forwards))
    order = [Action("F", i, p) for p, i in forwards[:warmup]]
    waiting: deque[Action] = deque()
    for k, (p, i) in enumerate(backwards):
        if warmup + k < len(forwards):
            order.append(Action("F", forwards[warmup + k][1], forwards[warmup + k][0]))
        order.append(Action("I", i, p))
        if held_back_w is not None:
            waiting.append(Action("W", i, p))
            if len(waiting) > held_back_w:
                order.append(waiting.popleft())
    return order + list(waiting)


def one_f_one_b(num_ranks: int, microbatches: int) -> Schedule:
    """Warm-up min(P - r - 1, M) forwards, steady one forward one backward, cool-down backwards."""
    _check(num_ranks, microbatches)
    return [_one_f_one_b_order([r], microbatches, microbatches, num_ranks - r - 1, None) for r in range(num_ranks)]


def interleaved_1f1b(num_ranks: int, microbatches: int, stages_per_rank: int = 2) -> Schedule:
    """1F1B over v looped stages per rank (depth first: a round of micro-batches through each stage)."""
    _check(num_ranks, microbatches, stages_per_rank)
    g = round_size(num_ranks, microbatches)
    return [
        _one_f_one_b_order(stages, microbatches, g, (stages_per_rank - 1) * g + 2 * (num_ranks - r - 1), None)
        for r, stages in enumerate(looped(num_ranks, stages_per_rank))
    ]


def zero_bubble(num_ranks: int, microbatches: int, stages_per_rank: int = 1) -> Schedule:
    """ZB-H1 (v = 1): 1F1B with split backwards, rank r holding back r W's; v >= 2 interleaved."""
    _check(num_ranks, microbatches, stages_per_rank)
    g = round_size(num_ranks, microbatches) if stages_per_rank > 1 else microbatches
    return [
        _one_f_one_b_order(stages, microbatches, g, (stages_per_rank - 1) * g + num_ranks - r - 1, r)
        for r, stages in enumerate(looped(num_ranks, stages_per_rank))
    ]


def zbv(num_ranks: int, microbatches: int) -> Schedule:
    """ZB-V: two stages per rank in a V, every backward split. Built for n = max(M, 2P - 1)
    micro-batches (what fills the V), then the actions of micro-batches >= M are dropped."""
    _check(num_ranks, microbatches)
    n, schedule = max(microbatches, 2 * num_ranks - 1), []
    for r, (down, up) in enumerate(v_shape(num_ranks)):
        order: list[Action] = []
        count = {(kind, p): 0 for kind in KINDS for p in (down, up)}

        def run(kind: str, p: int, order=order, count=count) -> None:
            order.append(Action(kind, count[kind, p], p))
            count[kind, p] += 1

        for _ in range(2 * (num_ranks - r) - 1):  # fill the way down
            run("F", down)
        for _ in range(r):  # the way up starts arriving
            run("F", up), run("F", down)
        for _ in range(num_ranks - r):  # first backwards, straight from the turn
            run("F", up), run("I", up), run("W", up)
        while count["F", up] < count["F", down] or count["F", down] < n:  # steady state
            if count["F", down] < n:
                run("F", down)
            run("I", down), run("W", down), run("F", up), run("I", up), run("W", up)
        w_down, w_up = count["I", down], count["I", up]
        for _ in range(r):  # drain: input gradients first
            run("I", down), run("I", up)
        for _ in range(num_ranks - r):
            run("I", down)
            order.append(Action("W", w_down, down))
            w_down += 1
        order += [Action("W", i, up) for i in range(w_up, count["I", up])]
        order += [Action("W", i, down) for i in range(w_down, count["I", down])]
        schedule.append([a for a in order if a.microbatch < microbatches])
    return schedule


# --- by name -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Kind:
    """A named schedule: how to build it, and the stages per rank it allows."""

    build: Callable[[int, int, int], Schedule]
    allowed_v: tuple[int, ...] | None  # None: any v >= 2
    title: str


SCHEDULES: dict[str, Kind] = {
    "gpipe": Kind(lambda p, m, v: gpipe(p, m), (1,), "GPipe"),
    "1f1b": Kind(lambda p, m, v: one_f_one_b(p, m), (1,), "1F1B"),
    "interleaved-1f1b": Kind(interleaved_1f1b, None, "interleaved 1F1B"),
    "zb-h1": Kind(lambda p, m, v: zero_bubble(p, m), (1,), "ZB-H1"),
    "interleaved-zb": Kind(zero_bubble, None, "interleaved ZB"),
    "zbv": Kind(lambda p, m, v: zbv(p, m), (2,), "ZB-V"),
    "looped-bfs": Kind(looped_bfs, None, "looped BFS"),
}


def make_schedule(name: str, num_ranks: int, microbatches: int, stages_per_rank: int = 1) -> Schedule:
    """The named schedule, with a clear error for a name or v it does not take."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {list(SCHEDULES)}")
    kind = SCHEDULES[name]
    allowed = kind.allowed_v or tuple(range(2, max(3, stages_per_rank + 1)))
    if stages_per_rank not in allowed:
        what = f"v in {list(kind.allowed_v)}" if kind.allowed_v else "v >= 2"
        raise ValueError(f"{kind.title} takes {what} stages per rank (--stages-per-rank), got v={stages_per_rank}")
    _check(num_ranks, microbatches, stages_per_rank)
    return kind.build(num_ranks, microbatches, stages_per_rank)


def check_schedule(schedule: Schedule) -> int:
    """M, after checking that the stages 0 .. vP-1 each live on one rank and run F and I exactly
    once per micro-batch (and W at most once, after its I). Raises ValueError otherwise."""
    seen: dict[Action, int] = {}
    for r, order in enumerate(schedule):
        for a in order:
            if a in seen:
                raise ValueError(f"{a.label} appears twice (ranks {seen[a]} and {r})")
            seen[a] = r
    stages = {a.stage: r for a, r in seen.items()}
    if sorted(stages) != list(range(len(stages))):
        raise ValueError(f"stages must be 0 .. vP-1, got {sorted(stages)}")
    for a, r in seen.items():
        if stages[a.stage] != r:
            raise ValueError(f"stage {a.stage} runs on more than one rank")
    m = 1 + max(a.microbatch for a in seen)
    for p in stages:
        for i in range(m):
            if Action("F", i, p) not in seen or Action("I", i, p) not in seen:
                raise ValueError(f"stage {p} must run F and I once for each of the {m} micro-batches")
    return m
