"""Exercise 04: this rank's stage and schedule in torch.distributed.pipelining (read
lessons/04_torch_pipelining.py first; check your answer with `pytest --exercises -k 04`).

Lessons 02 and 03 ran GPipe and 1F1B with our own runner. PyTorch's engine takes, on every rank, the
rank's stage wrapped as a `PipelineStage(module, p, P, device)` and a schedule object built from it,
`ScheduleGPipe(stage, M, loss_fn=...)` or `Schedule1F1B(stage, M, loss_fn=...)`; the caller then runs
`schedule.step(x)` on rank 0, `schedule.step(target=y, losses=[])` on the last rank, `schedule.step()`
in between (the judge makes those calls). Write `pipeline_for_rank`: return `(stage, schedule)` for
stage p of P, the schedule named `name` ("gpipe" or "1f1b") over M micro-batches, each micro-batch's
loss the mean squared error.

The loss's scale. PyTorch runs backward on each micro-batch's mean loss l_i and, with its default
`scale_grads=True`, divides the gradients by M at the end:

    grad = (1/M) sum_i dl_i/dtheta = dL/dtheta       (L the mean over all N rows, equal micro-batches)

while `scale_grads=False` (meant for a sum loss) leaves M times the gradient. The judge trains your
stages and compares their gradients and parameters with the unsplit model's, and the order PyTorch
executes with our schedules' (`distlab/pipeline/schedules.py`).

Hints:
- `from torch.distributed import pipelining`; `pipelining.PipelineStage`, `pipelining.ScheduleGPipe`,
  `pipelining.Schedule1F1B`;
- `loss_fn=torch.nn.functional.mse_loss`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: F401  (you will need it)


def pipeline_for_rank(
    module: torch.nn.Module, p: int, num_ranks: int, device: torch.device, name: str, microbatches: int
):
    """Stage p of P as torch's PipelineStage, and the schedule `name` ("gpipe": ScheduleGPipe, "1f1b":
    Schedule1F1B) that runs it over M micro-batches with the mean squared error as each one's loss."""
    raise NotImplementedError(
        "not written yet: pipeline_for_rank(module, p, num_ranks, device, name, "
        "microbatches), this rank's PipelineStage and torch's schedule built on it"
    )
