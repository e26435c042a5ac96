"""Exercise 06: data parallelism by hand (read lessons/06_data_parallel.py first; check your answer with
`pytest --exercises -k 06`).

Every rank holds the same model and a different C = N / P rows of the batch, and has just run backward
on the mean loss over its own rows, so param.grad holds dL_r/dtheta. Write `all_reduce_gradients`:
after it, every rank's param.grad must hold the gradient of the mean loss over all N rows,

    dL/dtheta = (1/N) sum_i dl_i/dtheta = (1/P) sum_r dL_r/dtheta     (equal shares: C rows each),

so that the same optimizer step on every rank keeps the replicas identical to one process on the whole batch.

Hints:
- `dist.all_reduce(t)` sums `t` over the ranks, in place, on every rank;
- the sum over ranks is P times the mean: divide by `rt.world_size`;
- leave every tensor on the device it is on (`rt.device`): the collective runs there.
"""

from __future__ import annotations

import torch.distributed as dist  # noqa: F401  (you will need it)
from torch import nn

from distlab.runtime import Runtime


def all_reduce_gradients(model: nn.Module, rt: Runtime) -> None:
    """After backward on this rank's rows: every param.grad becomes the mean over ranks."""
    raise NotImplementedError(
        "not written yet: all_reduce_gradients(model, rt), an all_reduce of every parameter's gradient, divided by P"
    )
