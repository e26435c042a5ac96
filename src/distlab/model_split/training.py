"""The pipeline track's configuration, its training (the one loop on a rank's stages), its unsplit reference.

Every pipeline in lessons 01-05 trains the same problem: `layered_mlp(widths, seed)` on one
regression batch of N rows (mean squared error, a mean over the whole batch), SGD for a few steps.
What differs is only how one step's forward and backward run: lesson 01's send/recv chain, our
runner executing a schedule (`runner.PipelineStep`), or PyTorch's engine (`torch_engine.TorchStep`).
Each of those supplies a `Step`; `train` runs it in the one training loop (`distlab.proof.training`), the
same way for all of them: zero the gradients, run the step, keep this rank's gradients after step 1
and its parameters after the last, step the optimizer; then it shares the losses.

`unsplit_reference(cfg)` is the independent check every lesson and test compares with: a deep
copy of the same model trained on the whole batch in one process with plain autograd.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from distlab.model_split.partition import Stage
from distlab.model_split.schedules import Action
from distlab.processes.identity import Runtime
from distlab.proof.models import DEFAULT_WIDTHS, layered_mlp, regression_batch
from distlab.proof.reference import one_process, sgd
from distlab.proof.timeline import Span, Timeline
from distlab.proof.training import Plain, Run
from distlab.proof.training import train as train_loop


@dataclass(frozen=True)
class PipelineConfig:
    """One pipeline run. The names follow the README's notation (N, M, v, K)."""

    widths: tuple[int, ...] = DEFAULT_WIDTHS  # layer i maps widths[i] -> widths[i + 1]
    global_batch: int = 64  # N rows per step
    steps: int = 1
    lr: float = 0.1
    schedule: str = "gpipe"  # a name in schedules.SCHEDULES
    micro_batches: int = 1  # M
    stages_per_rank: int = 1  # v
    checkpoint_segments: int = 0  # K: 0 = off, else >= 2
    seed: int = 0
    dtype: torch.dtype = torch.float64
    scale_loss: bool = True  # scale micro-batch i's mean loss by n_i / N (False: the bug)
    scale_grads: bool = True  # torch's engine: divide the gradients by M after the step
    input_features: int | None = None  # other than widths[0]: a batch that does not fit
    probe: bool = False  # measure saved-activation bytes and layer forwards
    gather_spans: bool = True  # share every rank's compute spans with every rank
    emulate_ms: float = 0.0  # > 0: the emulated device's ms per layer-pass (emulate.py)

    def replace(self, **changes) -> PipelineConfig:
        return dataclasses.replace(self, **changes)


def microbatch_sizes(global_batch: int, micro_batches: int) -> list[int]:
    """Rows per micro-batch, as `torch.tensor_split` cuts them: the first N mod M get one more."""
    if micro_batches < 1:
        raise ValueError(f"need at least one micro-batch (--micro-batches), got M={micro_batches}")
    if micro_batches > global_batch:
        raise ValueError(
            f"M={micro_batches} micro-batches (--micro-batches) of a batch of N={global_batch} "
            "(--global-batch): every micro-batch needs at least one row (M <= N)"
        )
    base, extra = divmod(global_batch, micro_batches)
    return [base + (1 if i < extra else 0) for i in range(micro_batches)]


def check_config(cfg: PipelineConfig) -> None:
    """What every rank can check alone, before any message: the same ValueError on every rank."""
    if cfg.global_batch < 1 or cfg.steps < 1:
        raise ValueError(f"N (--global-batch) and --steps must be >= 1, got {cfg.global_batch} and {cfg.steps}")
    microbatch_sizes(cfg.global_batch, cfg.micro_batches)
    if cfg.checkpoint_segments < 0 or cfg.checkpoint_segments == 1:
        raise ValueError(
            f"K (--checkpoint-segments) must be 0 (off) or >= 2, got {cfg.checkpoint_segments}: "
            "checkpoint_sequential runs its last segment without checkpointing, so K = 1 would "
            "checkpoint nothing"
        )


def problem(cfg: PipelineConfig) -> tuple[torch.nn.Sequential, torch.Tensor, torch.Tensor]:
    """The model and the batch (x, target), built identically on every rank from the seed."""
    model = layered_mlp(cfg.widths, seed=cfg.seed, dtype=cfg.dtype)
    x, target = regression_batch(
        cfg.global_batch, cfg.input_features or cfg.widths[0], cfg.widths[-1], seed=cfg.seed, dtype=cfg.dtype
    )
    return model, x, target


def unsplit_reference(cfg: PipelineConfig) -> Run:
    """The unsplit model trained on the whole batch in one process, plain autograd."""
    model, x, target = problem(cfg.replace(input_features=None))
    return one_process(model, lambda k: (x, target), F.mse_loss, sgd(cfg.lr), cfg.steps)


class Step(Protocol):
    """One pipeline's forward and backward of one batch, on this rank."""

    stages: list[Stage]  # this rank's stages (the parameters the optimizer steps)
    timeline: Timeline  # compute spans, recorded while stepping

    def __call__(self, step: int) -> float | None:
        """Accumulate this rank's gradients for the whole batch; the loss where the last stage is."""

    def measurements(self) -> dict:
        """Figures the step measured, as `PipelineRun` fields (peak_in_flight, saved_peak_bytes, ...)."""


@dataclass
class PipelineRun(Run):
    """A `distlab.proof.training.Run` of this rank's stages (gradients after step 1 and parameters after the
    last step, under the unsplit model's names; every step's loss, shared by every rank), and what the
    step measured."""

    stages: list[int] = field(default_factory=list)
    spans: list[Span] = field(default_factory=list)
    peak_in_flight: int = 0  # most (stage, micro-batch) activations held at once
    saved_peak_bytes: int = 0  # with probe: most activation bytes held for backward
    layer_forwards: int = 0  # with probe: layer forward calls in step 1
    executed: list[Action] = field(default_factory=list)  # torch's engine: what it ran, step 1
    planned: list[Action] = field(default_factory=list)  # torch's engine: its pipeline_order


def train(rt: Runtime, cfg: PipelineConfig, step: Step) -> PipelineRun:
    """`cfg.steps` SGD steps of the one loop (`distlab.proof.training.train`), each one call of `step`; a
    collective (call it on every rank)."""
    # This rank's layers as one module: their parameters keep the unsplit model's names ('3.0.weight').
    layers = nn.Sequential(OrderedDict(layer for s in step.stages for layer in s.module.named_children()))
    run = train_loop(Plain(layers, torch.optim.SGD(layers.parameters(), lr=cfg.lr)), step, cfg.steps)
    # Only the rank with the last stage has the losses; a sum with everyone else's zeros shares them
    # in one collective (exactly: x + 0 = x).
    shared = torch.tensor(run.losses or [0.0] * cfg.steps, dtype=torch.float64, device=rt.device)
    dist.all_reduce(shared)
    spans = step.timeline.gather() if cfg.gather_spans else step.timeline.spans
    return PipelineRun(
        run.first_grads,
        run.params,
        shared.tolist(),
        stages=[s.index for s in step.stages],
        spans=spans,
        **step.measurements(),
    )
