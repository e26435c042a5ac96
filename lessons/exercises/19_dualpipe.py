"""Exercise 19: DualPipeV as data (read lessons/19_dualpipe.py first; check your answer with
`pytest --exercises -k 19`; add `--hint-level 1`, 2 or 3 for help).

P ranks hold 2P half-size stages in a V: rank r holds stage a = r (on the way down) and b = 2P - 1 - r (on
the way up). Write `dualpipev`: for each rank, its units of work in order, each unit a tuple of one
`Action(kind, microbatch, stage)` or an overlapped pair (forward, backward) of two, following the eight
phases of the lesson's docstring:

    1. 2 (P - r - 1) x F(a)            2. r + 1 x F(a), F(b)          3. P - r - 1 x I(b), W, F(b)
    4. M - 2P + r + 1 x (F(a), B(b)), (F(b), B(a))    (rank P - 1's first F(a), B(b) as two units)
    5. P - r - 1 x B(b), (F(b), B(a))  6. r + 1 x B(b), B(a), split into I and a held-back W from the middle on
    7. P - r - 1 x W, B(a) or I(a)     8. r + 1 x W

Micro-batches are taken in order, per (kind, stage). A full backward B is Action("I", i, p) with no W for
(p, i); a split one is Action("I", i, p) now and Action("W", i, p) later, the oldest held-back W first. In
phase 6 the split starts at k = (r + 1) // 2: before the B(b) on odd ranks, after it on even ones.

The judge (P = 2, M = 6) runs your order, flattened (a pair as its forward, then its backward), through the
pipeline runner against the unsplit model; counts the grid's bubble ((P - 1)/(6M + P - 1)), the activations
each rank holds (2P + 1), the pairs; and asks torch's ScheduleDualPipeV for its plan.
"""

from __future__ import annotations

from distlab.model_split.schedules import Action  # noqa: F401 -- what the units are made of


def dualpipev(num_ranks: int, microbatches: int) -> list[list[tuple]]:
    """Per rank, its units in order: (action,) or an overlapped pair (forward, backward)."""
    raise NotImplementedError("not written yet: dualpipev(num_ranks, microbatches)")
