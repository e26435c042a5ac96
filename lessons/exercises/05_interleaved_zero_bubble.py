"""Exercise 05: the zero-bubble schedule ZB-H1, as data (read lessons/05_interleaved_zero_bubble.py first;
check your answer with `pytest --exercises -k 05`; add `--hint-level 1`, 2 or 3 for help).

A schedule is, per rank r, the ordered list of actions that rank runs on its one stage (stage r):
`Action("F", i, r)` the forward of micro-batch i; `Action("I", i, r)` the gradient of the stage's input,
which rank r - 1 waits for; `Action("W", i, r)` the weights' gradient, split off I, which no one waits for.
Write `zb_h1(num_ranks, microbatches)`: 1F1B's order (lesson 03) with every backward split into I and W,
and the W's placed where 1F1B would idle, waiting for a gradient. With t_F = t_I = t_W = 1 tick, each rank
has 3M ticks of work and may idle only the P - 1 ticks micro-batch 0 needs to reach the last rank (M >= P):

    bubble = (P - 1) / (3M + P - 1)          (1F1B: (P - 1) / (M + P - 1)),

while rank r holds min(M, P) micro-batches at once: a micro-batch's activations are freed by its W, so every
W held back keeps one more micro-batch alive; ZB-H1 spends that memory where it buys idle ticks, and no more.

The runner executes your lists on real ranks; the judge checks that they form a schedule (every F, I and W
once, W after its I, no deadlock), the gradients and parameters against the unsplit model, the bubble
counted in your schedule's grid, and what each rank held while running (P = 3, M = 4).
"""

from __future__ import annotations

from distlab.model_split.schedules import Action, Schedule  # noqa: F401  (you will need them)


def zb_h1(num_ranks: int, microbatches: int) -> Schedule:
    """P lists, one per rank (rank r runs stage r): the F, I and W actions of ZB-H1's order."""
    raise NotImplementedError("not written yet: zb_h1(num_ranks, microbatches)")
