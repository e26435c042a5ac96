"""Exercise 02: the GPipe schedule, as data (read lessons/02_gpipe_checkpoint.py first; check your answer
with `pytest --exercises -k 02`; add `--hint-level 1`, 2 or 3 for help).

A schedule is, per rank r, the ordered list of actions that rank runs on its one stage (stage r):
`Action("F", i, r)` the forward of micro-batch i, `Action("I", i, r)` its backward
(distlab/model_split/schedules.py). Write `gpipe(num_ranks, microbatches)`: the batch of N rows is cut into M
micro-batches, and the pipeline must fill: stage p forwards micro-batch i while stage p + 1 forwards i - 1,
so that of the (M + P - 1)(t_F + t_I) a step takes, each rank idles only

    bubble = (P - 1) / (M + P - 1)        (1 - 1/P for M = 1: lesson 01).

GPipe's price: every stage holds the saved activations of all M micro-batches at once, until its first
backward (which the lesson's checkpointing then shrinks).

The runner executes your lists on real ranks; the judge checks that they form a schedule (every F and I
once, no deadlock), the gradients and parameters against the unsplit model, the bubble counted in your
schedule's grid, and what each rank held while running.
"""

from __future__ import annotations

from distlab.model_split.schedules import Action, Schedule  # noqa: F401  (you will need them)


def gpipe(num_ranks: int, microbatches: int) -> Schedule:
    """P lists, one per rank (rank r runs stage r): the F and I actions of GPipe's order."""
    raise NotImplementedError("not written yet: gpipe(num_ranks, microbatches)")
