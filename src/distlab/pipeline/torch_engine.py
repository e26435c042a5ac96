"""The same split model run by the real engine: `torch.distributed.pipelining`.

Each rank wraps its stage's `nn.Sequential` in a `PipelineStage` and hands it to a schedule
(`ScheduleGPipe` or `Schedule1F1B`). Rank 0 calls `schedule.step(x)` with the whole batch, the last
rank `schedule.step(target=y, losses=...)`, the others `schedule.step()`; the schedule cuts the batch
into M micro-batches, runs the actions, and does the transfers.

Where it differs from our runner (torch 2.13):
- Loss reduction: it calls backward on each micro-batch's loss as the loss function returns it and,
  with `scale_grads=True` (the default), divides the gradients by M after the step. For a mean loss
  that is the mean of the micro-batch means: the batch mean only when all micro-batches have the
  same size. (Ours scales each loss by n_i / N, exact for any sizes.) `scale_grads=False` is for a
  sum loss; with a mean loss it gives M times the gradient.
- Even micro-batches only: a stage infers the shapes it receives from micro-batch 0 and reuses
  them, so a batch that M does not divide fails inside the step (a shape mismatch on one rank, a
  closed connection on the others). We refuse it up front instead, on every rank.
- `Schedule1F1B` refuses M < P in its constructor; ours degenerates gracefully towards GPipe.
- `schedule.pipeline_order`, its printed per-rank plan, is not what runs: for 1F1B the last rank's
  plan reads F1 .. F_M instead of F0 .. F_{M-1}. We record the order it *executes* by wrapping the
  stage's `forward_one_chunk` / `backward_one_chunk`, and compare that with ours.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import torch
import torch.nn.functional as F

from distlab.models import layered_mlp, regression_batch
from distlab.pipeline import p2p
from distlab.pipeline.partition import boundary_shapes, split_stages
from distlab.pipeline.schedules import Action
from distlab.runtime import Runtime

TORCH_SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B"}


@dataclass
class TorchPipelineRun:
    stage: int
    first_grads: dict[str, torch.Tensor]
    params: dict[str, torch.Tensor]
    losses: list[float]                                        # whole-batch loss per step
    executed: list[Action] = field(default_factory=list)       # compute actions it ran, step 1
    planned: list[Action] = field(default_factory=list)        # what schedule.pipeline_order says


@contextmanager
def _recording(stage, log: list[Action]) -> Iterator[None]:
    """Log every forward and backward the schedule runs on this stage, in order.

    The wrappers hold the stage's bound methods, so while installed they form a reference cycle
    with the stage; removing them on the way out lets the stage (and the transfer buffers it
    holds) go when the run ends instead of at the next garbage collection."""
    forward, backward = stage.forward_one_chunk, stage.backward_one_chunk

    def forward_one_chunk(chunk_id, *args, **kwargs):
        log.append(Action("F", chunk_id))
        return forward(chunk_id, *args, **kwargs)

    def backward_one_chunk(chunk_id, *args, **kwargs):
        log.append(Action("B", chunk_id))
        return backward(chunk_id, *args, **kwargs)

    stage.forward_one_chunk, stage.backward_one_chunk = forward_one_chunk, backward_one_chunk
    try:
        yield
    finally:
        del stage.forward_one_chunk, stage.backward_one_chunk  # back to the class's methods


def train_torch_pipeline(rt: Runtime, widths: tuple[int, ...], batch_size: int, steps: int, lr: float,
                         schedule: str = "gpipe", microbatches: int = 1, seed: int = 0,
                         dtype: torch.dtype = torch.float64, scale_grads: bool = True) -> TorchPipelineRun:
    """`steps` SGD steps of `layered_mlp(widths, seed)`, split as ours is, run by PyTorch's schedule."""
    from torch.distributed import pipelining  # imported here: a second of imports, only when used

    if schedule not in TORCH_SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; choose one of {list(TORCH_SCHEDULES)}")
    if microbatches < 1 or batch_size % microbatches:
        raise ValueError(f"torch.distributed.pipelining needs equal micro-batches: a batch of {batch_size} "
                         f"does not split into M={microbatches} (it reuses micro-batch 0's shapes)")
    model = layered_mlp(widths, seed=seed, dtype=dtype)
    stages = split_stages(model, rt.world_size)
    x, target = regression_batch(batch_size, widths[0], widths[-1], seed=seed, dtype=dtype)
    boundary_shapes(stages, tuple(x.shape), dtype)  # the same "does not fit" check as ours
    mine = stages[rt.rank]
    mine.module.to(rt.device)
    stage = pipelining.PipelineStage(mine.module, rt.rank, rt.world_size, rt.device)
    # Schedule1F1B raises ValueError for M < P here, on every rank, before any message.
    runner = getattr(pipelining, TORCH_SCHEDULES[schedule])(
        stage, microbatches, loss_fn=F.mse_loss, scale_grads=scale_grads)
    planned = [Action(a.computation_type.value, a.microbatch_index)
               for a in (runner.pipeline_order or {}).get(rt.rank, [])
               if a is not None and a.computation_type.value in ("F", "B")]
    log: list[Action] = []
    optimizer = torch.optim.SGD(mine.module.parameters(), lr=lr)
    losses, first_grads, executed = [], {}, []
    with _recording(stage, log):
        for step in range(steps):
            optimizer.zero_grad(set_to_none=True)
            micro_losses: list[torch.Tensor] = []
            if rt.is_first and rt.is_last:
                runner.step(x.to(rt.device), target=target.to(rt.device), losses=micro_losses)
            elif rt.is_first:
                runner.step(x.to(rt.device))
            elif rt.is_last:
                runner.step(target=target.to(rt.device), losses=micro_losses)
            else:
                runner.step()
            if rt.is_last:  # equal micro-batches: the batch mean is the mean of the micro-batch means
                losses.append(torch.stack(micro_losses).mean().item())
            if step == 0:
                first_grads = mine.grads()
                executed = list(log)
            optimizer.step()

    losses = p2p.losses_from_last_stage(losses, steps, rt.device)
    return TorchPipelineRun(mine.index, first_grads, mine.params(), losses, executed, planned)
