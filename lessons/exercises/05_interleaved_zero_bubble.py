"""Exercise 05: the zero-bubble schedule ZB-H1, as data (read lessons/05_interleaved_zero_bubble.py first;
check your answer with `pytest --exercises -k 05`).

A schedule is, per rank r, the ordered list of actions that rank runs on its one stage (stage r):
`Action("F", i, r)` the forward of micro-batch i; `Action("I", i, r)` the gradient of the stage's input,
which rank r - 1 waits for; `Action("W", i, r)` the weights' gradient, split off I, which no one waits for.
Write `zb_h1`: rank r runs 1F1B's order with every backward split,

    warm up with min(P - r - 1, M) forwards,
    then one forward (while any remain) and one I in turn, the newest forward and the oldest I,
    after each I: queue its W, and run the oldest queued W only once more than r are queued,
    at the end: the queued W's,

so that rank r holds back r W's, which fill the ticks where 1F1B would wait for a gradient. With
t_F = t_I = t_W = 1 tick, each rank has 3M ticks of work and idles only the P - 1 ticks micro-batch 0
needs to reach the last rank (M >= P):

    bubble = (P - 1) / (3M + P - 1)          (1F1B: (P - 1) / (M + P - 1), a third fewer idle ticks per work)

and rank r holds min(M, P) micro-batches (1F1B's P - r, plus the r W's it holds back). The runner
executes your lists on real ranks; the judge checks the gradients against the unsplit model, counts the
bubble in your schedule's grid and what each rank held while running.

Hints:
- `from distlab.pipeline.schedules import Action`; `Action(kind, microbatch, stage)`;
- a `collections.deque` of waiting W's: append after each I, popleft when its length exceeds r;
- rank 0 holds back none: its W runs right after its I.
"""

from __future__ import annotations

from collections import deque  # noqa: F401  (you will need it)

from distlab.pipeline.schedules import Action, Schedule  # noqa: F401  (you will need them)


def zb_h1(num_ranks: int, microbatches: int) -> Schedule:
    """Rank r: 1F1B's order (min(P - r - 1, M) warm-up forwards, then one forward and one backward in
    turn) with every backward split into I and W, and the W's held back: the oldest waiting W runs
    only once more than r are waiting; the last r run at the end, where 1F1B would idle."""
    raise NotImplementedError(
        "not written yet: zb_h1(num_ranks, microbatches), each rank's list of F, I and W "
        "actions: 1F1B's order with rank r holding back r W's"
    )
