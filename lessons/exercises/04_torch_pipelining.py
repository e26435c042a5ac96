"""Exercise 04: this rank's stage and schedule in torch.distributed.pipelining (read
lessons/04_torch_pipelining.py first; check your answer with `pytest --exercises -k 04`; add `--hint-level 1`,
2 or 3 for help).

Lessons 02 and 03 ran GPipe and 1F1B with our own runner. PyTorch's engine takes, on every rank, the rank's
module wrapped as stage p of P, and a schedule object built on that stage that knows the number of
micro-batches and the loss; the caller then steps the schedule on every rank, the batch on rank 0 and the
target on the last (the judge makes those calls). Write `pipeline_for_rank`: return `(stage, schedule)` for
stage p of P, the schedule named `name` ("gpipe" or "1f1b", the classes of torch.distributed.pipelining that
bear those names) over M micro-batches, each micro-batch's loss the mean squared error.

The loss's scale. PyTorch back-propagates each micro-batch's loss l_i; to match the unsplit model, whose
loss L is the mean over all N rows, the gradient must come out as

    grad = (1/M) sum_i dl_i/dtheta = dL/dtheta       (l_i the mean over micro-batch i's rows, equal sizes).

The judge trains your stages for 2 steps with both schedules (P = 3, M = 4) and compares their gradients and
parameters with the unsplit model's, and the order of forwards and backwards PyTorch executes with our
schedules' (distlab/model_split/schedules.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: F401  (you will need it)


def pipeline_for_rank(
    module: torch.nn.Module, p: int, num_ranks: int, device: torch.device, name: str, microbatches: int
):
    """Stage p of P, and the schedule `name` that runs it over M micro-batches, each one's loss the mean
    squared error."""
    raise NotImplementedError("not written yet: pipeline_for_rank(module, p, num_ranks, device, name, microbatches)")
