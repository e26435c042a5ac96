"""Naive model parallelism: the layers split across ranks, the whole batch passed down and back.

Forward, on stage s: receive the activation A_{s-1} from rank s-1 (rank 0 starts from the batch),
compute A_s = f_s(A_{s-1}), send A_s to rank s+1. Backward: the last stage computes the loss and
calls `loss.backward()`; every other stage receives dL/dA_s, calls `A_s.backward(dL/dA_s)`, and sends
dL/dA_{s-1} (the `.grad` of its received input) on to rank s-1. Each stage then steps its own
optimizer: every parameter lives on exactly one rank, so no gradient is ever averaged.

Every send is matched by a receive that waits for it, so at any instant exactly one rank computes:
the idle time that pipelining (lesson 02) cures.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from distlab.models import layered_mlp, regression_batch
from distlab.pipeline import p2p
from distlab.pipeline.partition import Stage, boundary_shapes, split_stages
from distlab.runtime import Runtime
from distlab.timeline import Span, Timeline


def model_parallel_step(rt: Runtime, stage: Stage, shapes: list[torch.Size], x: torch.Tensor,
                        target: torch.Tensor, loss_fn: Callable[..., torch.Tensor],
                        timeline: Timeline, step: int = 0) -> torch.Tensor | None:
    """Forward and backward of one batch through the stages; returns the loss on the last rank.

    `x` is read only on rank 0 and `target` only on the last rank; `shapes` (from
    `boundary_shapes`) tells each rank what it is about to receive.
    """
    dtype, device = x.dtype, rt.device
    s, last = stage.index, rt.world_size - 1
    # Forward: receive, compute, send.
    if s == 0:
        inputs = x.to(device)
    else:
        inputs = p2p.recv(shapes[s], dtype, device, src=s - 1, requires_grad=True)
    with timeline.span("F", step):
        outputs = stage.module(inputs)
    if s != last:
        p2p.send(outputs, dst=s + 1)
    # Backward: the last stage starts it from the loss, the others from the received gradient.
    loss = None
    if s == last:
        with timeline.span("B", step):
            loss = loss_fn(outputs, target.to(device))
            loss.backward()
    else:
        grad_outputs = p2p.recv(outputs.shape, dtype, device, src=s + 1)
        with timeline.span("B", step):
            outputs.backward(grad_outputs)
    if s != 0:
        p2p.send(inputs.grad, dst=s - 1)
    return loss


@dataclass
class ModelParallelRun:
    """What one rank saw: its stage's gradients after step 1 and parameters after the last step
    (under the unsplit model's names), every step's loss, and every rank's compute spans."""

    stage: int
    first_grads: dict[str, torch.Tensor]
    params: dict[str, torch.Tensor]
    losses: list[float]
    spans: list[Span]


def train_model_parallel(rt: Runtime, widths: tuple[int, ...], batch_size: int, steps: int,
                         lr: float, seed: int = 0, dtype: torch.dtype = torch.float64,
                         input_features: int | None = None) -> ModelParallelRun:
    """`steps` SGD steps of `layered_mlp(widths, seed)` split over the ranks, on one regression
    batch (mean squared error over the whole batch). `input_features` other than widths[0] makes a
    batch that does not fit the model, to show the error."""
    if batch_size < 1 or steps < 1:
        raise ValueError(f"batch_size and steps must be >= 1, got {batch_size} and {steps}")
    # Every rank builds the whole model and batch from the seed and validates them the same way,
    # before any message: a bad configuration fails on every rank instead of hanging some.
    model = layered_mlp(widths, seed=seed, dtype=dtype)
    stages = split_stages(model, rt.world_size)
    x, target = regression_batch(batch_size, input_features or widths[0], widths[-1],
                                 seed=seed, dtype=dtype)
    shapes = boundary_shapes(stages, tuple(x.shape), dtype)

    stage = stages[rt.rank]
    stage.module.to(rt.device)
    optimizer = torch.optim.SGD(stage.module.parameters(), lr=lr)
    timeline = Timeline(rt.rank)
    losses, first_grads = [], {}
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss = model_parallel_step(rt, stage, shapes, x, target, F.mse_loss, timeline, step)
        if loss is not None:
            losses.append(loss.item())
        if step == 0:
            first_grads = stage.grads()
        optimizer.step()

    losses = p2p.losses_from_last_stage(losses, steps, rt.device)
    return ModelParallelRun(
        stage=stage.index,
        first_grads=first_grads,
        params=stage.params(),
        losses=losses,
        spans=timeline.gather(),
    )
