"""Exercise 02: the GPipe schedule, as data (read lessons/02_gpipe_checkpoint.py first; check your answer
with `pytest --exercises -k 02`).

A schedule is, per rank r, the ordered list of actions that rank runs on its one stage (stage r):
`Action("F", i, r)` the forward of micro-batch i, `Action("I", i, r)` its backward. Write `gpipe`: the
batch of N rows is cut into M micro-batches, and every rank runs

    all M forwards F_0 .. F_{M-1}, then all M backwards I_0 .. I_{M-1}     (first in, first out),

so that stage p forwards micro-batch i while stage p + 1 forwards i - 1: the pipeline fills, and of the
(M + P - 1)(t_F + t_I) a step takes, each rank idles

    bubble = (P - 1) / (M + P - 1)        (1 - 1/P for M = 1: lesson 01).

The price: every stage holds the saved activations of all M micro-batches until its first backward
(which the lesson's checkpointing then shrinks). The runner executes your lists on real ranks, with and
without checkpoint_sequential; the judge checks the gradients against the unsplit model, counts the
bubble in your schedule's grid and what each rank held while running.

Hints:
- `from distlab.pipeline.schedules import Action`; `Action(kind, microbatch, stage)`;
- a list per rank, P lists in all; rank r's stage is r.
"""

from __future__ import annotations

from distlab.pipeline.schedules import Action, Schedule  # noqa: F401  (you will need them)


def gpipe(num_ranks: int, microbatches: int) -> Schedule:
    """Rank r runs stage r: every forward F_0 .. F_{M-1}, then every backward I_0 .. I_{M-1}."""
    raise NotImplementedError(
        "not written yet: gpipe(num_ranks, microbatches), each rank's list of F and I "
        "actions: every forward, then every backward"
    )
