"""Run a schedule: one rank executes its own action list, micro-batch by micro-batch.

The batch of N samples is cut into M micro-batches of n_0 .. n_{M-1} rows (`torch.tensor_split`:
the first N mod M get one row more, so any N >= M works). On stage s, action
  F(i): take micro-batch i (rank 0) or the received activation, compute the stage, keep what the
        backward needs, send the output on. The last stage computes the loss of micro-batch i.
  B(i): resume backpropagation from the loss (last stage) or from the received output gradient,
        send the gradient of the input back. Parameter gradients accumulate over micro-batches.
Transfers go through `p2p.comm_plan`/`p2p.exchange`: sends of one action posted together with the
receives of the next, so neither GPipe nor 1F1B deadlocks for any P and M (p2p.py says why blocking
send/recv would; the tests replay every rank's plan to show it).

The loss over a step is the mean over the whole batch. A per-micro-batch loss l_i is a mean over
its n_i rows, and
    L = (1/N) sum_rows loss(row) = sum_i (n_i / N) * l_i,
so each micro-batch loss is scaled by n_i / N before its backward; the accumulated gradients are
then exactly dL/dW, for uneven micro-batches too. Forgetting the scale (seed 004 calls backward on
each micro-batch's loss as it is) trains on sum_i l_i, M times the mean for even micro-batches: an
M-times gradient that a loss curve hides and a gradient comparison does not. (PyTorch's schedules
instead divide the gradients by M after the step, `scale_grads=True`: exact only when every
micro-batch has the same size; lesson 04 shows it.)

Optional activation checkpointing: each stage runs `checkpoint_sequential(layers, K,
use_reentrant=False)`, which saves only the input of each of its first K-1 segments and reruns
them during backward. Its last segment always runs normally, so K = 1 would checkpoint nothing;
K is clamped to the stage's layer count.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint_sequential

from distlab.models import layered_mlp, regression_batch
from distlab.pipeline import p2p
from distlab.pipeline.partition import Stage, boundary_shapes, split_stages
from distlab.pipeline.probe import StageProbe
from distlab.pipeline.schedules import Action, make_schedule
from distlab.runtime import Runtime
from distlab.timeline import Span, Timeline


def microbatch_sizes(batch_size: int, num_microbatches: int) -> list[int]:
    """Rows per micro-batch, as `torch.tensor_split` cuts them: the first N mod M get one more."""
    if num_microbatches < 1:
        raise ValueError(f"need at least one micro-batch, got M={num_microbatches}")
    if num_microbatches > batch_size:
        raise ValueError(f"{num_microbatches} micro-batches of a batch of {batch_size}: "
                         "every micro-batch needs at least one sample (M <= batch size)")
    base, extra = divmod(batch_size, num_microbatches)
    return [base + (1 if i < extra else 0) for i in range(num_microbatches)]


def check_checkpoint_segments(segments: int) -> None:
    if segments < 0 or segments == 1:
        raise ValueError(
            f"checkpoint segments must be 0 (off) or >= 2, got {segments}: checkpoint_sequential "
            "runs its last segment without checkpointing, so K = 1 would checkpoint nothing")


def stage_forward(module: nn.Sequential, x: torch.Tensor, segments: int) -> torch.Tensor:
    """The stage's forward, checkpointed in min(K, layers) segments when K >= 2."""
    k = min(segments, len(module))
    if k >= 2:
        return checkpoint_sequential(module, k, x, use_reentrant=False)
    return module(x)


@dataclass
class StepResult:
    loss: float | None      # last stage: the loss of the whole batch (sum of the scaled l_i)
    peak_in_flight: int     # measured: most micro-batches forwarded and not yet backwarded


def pipeline_step(stage: Stage, num_stages: int, actions: list[Action],
                  x_mbs: list[torch.Tensor], target_mbs: list[torch.Tensor],
                  shapes: list[list[torch.Size]], loss_fn: Callable[..., torch.Tensor],
                  device: torch.device, checkpoint_segments: int = 0, scale_loss: bool = True,
                  timeline: Timeline | None = None, step: int = 0,
                  probe: StageProbe | None = None) -> StepResult:
    """Execute `actions` on `stage`. `x_mbs` is read on the first stage, `target_mbs` on the last;
    `shapes[i]` are micro-batch i's `boundary_shapes` (P + 1 of them)."""
    s, last = stage.index, stage.index == num_stages - 1
    dtype = x_mbs[0].dtype
    batch_size = sum(len(x) for x in x_mbs)
    held: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # i -> (stage input, output or loss)
    outbox: dict[tuple[str, int], torch.Tensor] = {}          # computed, to be sent in the next batch
    inbox: dict[tuple[str, int], torch.Tensor] = {}
    in_flight = peak = 0
    total = torch.zeros((), dtype=torch.float64)
    span = timeline.span if timeline else lambda *_: nullcontext()
    record = probe.forward if probe else lambda _: nullcontext()

    def post(batch: list[p2p.Transfer]) -> None:
        sends = [(outbox.pop((t.what, t.microbatch)), t.peer) for t in batch if t.op == "send"]
        recvs = [t for t in batch if t.op == "recv"]
        # An activation enters this stage: shapes[i][s]; a gradient is of this stage's output: [s + 1].
        got = p2p.exchange(sends, [(shapes[t.microbatch][s + (t.what == "gradient")], t.peer)
                                   for t in recvs], dtype, device)
        inbox.update({(t.what, t.microbatch): g for t, g in zip(recvs, got)})

    plan = p2p.comm_plan(actions, s, num_stages)
    for action, batch in zip(actions, plan):
        post(batch)
        i = action.microbatch
        if action.kind == "F":
            x = x_mbs[i].to(device) if s == 0 else inbox.pop(("activation", i)).requires_grad_()
            with span(f"F{i}", step), record(i):
                out = stage_forward(stage.module, x, checkpoint_segments)
                if last:
                    out = loss_fn(out, target_mbs[i].to(device))
                    if scale_loss:
                        out = out * (len(x) / batch_size)  # n_i / N: the whole batch's mean
                    total += out.detach().cpu()
            if not last:
                outbox[("activation", i)] = out
            held[i] = (x, out)
            in_flight += 1
            peak = max(peak, in_flight)
        else:
            x, out = held.pop(i)
            with span(f"B{i}", step):
                out.backward(None if last else inbox.pop(("gradient", i)))
            if s > 0:
                outbox[("gradient", i)] = x.grad
            if probe:
                probe.release(i)
            in_flight -= 1
    post(plan[-1])
    return StepResult(total.item() if last else None, peak)


@dataclass
class PipelineRun:
    """What one rank saw: its stage's gradients after step 1 and parameters after the last step
    (under the unsplit model's names), every step's loss, peaks, and every rank's compute spans."""

    stage: int
    first_grads: dict[str, torch.Tensor]
    params: dict[str, torch.Tensor]
    losses: list[float]
    peak_in_flight: int
    spans: list[Span]
    saved_peak_bytes: int = 0       # with probe=True: most activation bytes held for backward
    layer_forwards: int = 0         # with probe=True: layer forward calls in the first step


@dataclass
class Prepared:
    """One rank's share of a pipeline run, validated and ready for `pipeline_step`."""

    stage: Stage
    actions: list[Action]
    x_mbs: list[torch.Tensor]
    target_mbs: list[torch.Tensor]
    shapes: list[list[torch.Size]]


def prepare(rt: Runtime, widths: tuple[int, ...], batch_size: int, schedule: str, microbatches: int,
            checkpoint_segments: int = 0, seed: int = 0, dtype: torch.dtype = torch.float64,
            input_features: int | None = None) -> Prepared:
    """Build the model, the batch and this rank's stage, schedule and shapes from the seed."""
    # Everything is validated on every rank from what every rank knows, before any message:
    # bad input fails the same way everywhere instead of leaving some rank waiting in a receive.
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    actions = make_schedule(schedule, rt.world_size, microbatches)[rt.rank]
    sizes = microbatch_sizes(batch_size, microbatches)
    check_checkpoint_segments(checkpoint_segments)
    model = layered_mlp(widths, seed=seed, dtype=dtype)
    stages = split_stages(model, rt.world_size)
    x, target = regression_batch(batch_size, input_features or widths[0], widths[-1],
                                 seed=seed, dtype=dtype)
    by_size = {n: boundary_shapes(stages, (n, *x.shape[1:]), dtype) for n in set(sizes)}
    stage = stages[rt.rank]
    stage.module.to(rt.device)
    # With NCCL, a batch_isend_irecv that is the group's first collective must involve every rank,
    # and ours involve two. One barrier first makes every later batch a legal subset.
    dist.barrier()
    return Prepared(stage, actions, list(torch.tensor_split(x, microbatches)),
                    list(torch.tensor_split(target, microbatches)),
                    [by_size[n] for n in sizes])  # uneven micro-batches: shapes differ in the batch dim


def train_pipeline(rt: Runtime, widths: tuple[int, ...], batch_size: int, steps: int, lr: float,
                   schedule: str = "gpipe", microbatches: int = 1, checkpoint_segments: int = 0,
                   seed: int = 0, dtype: torch.dtype = torch.float64, scale_loss: bool = True,
                   input_features: int | None = None, probe: bool = False,
                   gather_spans: bool = True) -> PipelineRun:
    """`steps` SGD steps of `layered_mlp(widths, seed)` split over the ranks and run by the named
    schedule on M micro-batches of one regression batch (MSE, the mean over the whole batch)."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    run = prepare(rt, widths, batch_size, schedule, microbatches, checkpoint_segments, seed, dtype,
                  input_features)
    stage = run.stage
    stage_probe = StageProbe(stage.module) if probe else None
    optimizer = torch.optim.SGD(stage.module.parameters(), lr=lr)
    timeline = Timeline(rt.rank)
    losses, first_grads, peak, layer_forwards = [], {}, 0, 0
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        result = pipeline_step(stage, rt.world_size, run.actions, run.x_mbs, run.target_mbs, run.shapes,
                               F.mse_loss, rt.device, checkpoint_segments, scale_loss, timeline, step,
                               stage_probe)
        if result.loss is not None:
            losses.append(result.loss)
        peak = max(peak, result.peak_in_flight)
        if step == 0:
            first_grads = stage.grads()
            layer_forwards = stage_probe.layer_forwards if stage_probe else 0
        optimizer.step()
    if stage_probe:
        stage_probe.remove()

    losses = p2p.losses_from_last_stage(losses, steps, rt.device)
    return PipelineRun(
        stage=stage.index,
        first_grads=first_grads,
        params=stage.params(),
        losses=losses,
        peak_in_flight=peak,
        spans=timeline.gather() if gather_spans else timeline.spans,
        saved_peak_bytes=stage_probe.peak_bytes if stage_probe else 0,
        layer_forwards=layer_forwards,
    )
