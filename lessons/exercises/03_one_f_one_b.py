"""Exercise 03: the 1F1B schedule, as data (read lessons/03_one_f_one_b.py first; check your answer with
`pytest --exercises -k 03`; add `--hint-level 1`, 2 or 3 for help).

A schedule is, per rank r, the ordered list of actions that rank runs on its one stage (stage r):
`Action("F", i, r)` the forward of micro-batch i, `Action("I", i, r)` its backward (the input's gradient,
which rank r - 1 waits for, and here also the weights' gradient). Write `one_f_one_b(num_ranks,
microbatches)`: the order in which each micro-batch's activations are freed as early as the pipeline allows,
so that rank r never holds more than

    min(M, P - r) micro-batches at once            (GPipe: all M),

while the pipeline stays as full as GPipe's: the bubble is still (P - 1) / (M + P - 1). A micro-batch's
activations are freed by its backward; a backward on rank r can run only after the gradient from rank r + 1
has come, and rank r + 1 runs it only after the forward from rank r. Both M < P and M > P must work.

The runner executes your lists on real ranks; the judge checks that they form a schedule (every F and I
once, no deadlock), the gradients and parameters against the unsplit model, what each rank held while
running, and the bubble counted in your schedule's grid, for M = 5 and M = 2 on P = 3.
"""

from __future__ import annotations

from distlab.model_split.schedules import Action, Schedule  # noqa: F401  (you will need them)


def one_f_one_b(num_ranks: int, microbatches: int) -> Schedule:
    """P lists, one per rank (rank r runs stage r): the F and I actions of 1F1B's order."""
    raise NotImplementedError("not written yet: one_f_one_b(num_ranks, microbatches)")
