"""The same split model run by the real engine: `torch.distributed.pipelining` (torch 2.13).

Each rank wraps each of its stages' `nn.Sequential` in a `PipelineStage(module, p, vP, device)` and
hands them to a schedule class; the rank with stage 0 calls `schedule.step(x)` with the whole batch,
the rank with the last stage `schedule.step(target=y, losses=...)` (with V placement that is rank 0
too: `step(x, target=y, losses=...)`), the others `schedule.step()`. The schedule cuts the batch into
M micro-batches, runs the actions and does the transfers. Its seven schedules, and ours:

    ScheduleGPipe                  gpipe              Schedule1F1B           1f1b
    ScheduleInterleaved1F1B        interleaved-1f1b   ScheduleLoopedBFS      looped-bfs
    ScheduleInterleavedZeroBubble  zb-h1 (v = 1), interleaved-zb (v >= 2)
    ScheduleZBVZeroBubble          zbv                ScheduleDualPipeV      (none of ours)

Where it differs from our runner:
- Loss reduction: backward on each micro-batch's loss as the loss function returns it, then, with
  `scale_grads=True` (the default), the gradients divided by M: the mean of the micro-batch means,
  the batch mean only when all micro-batches have the same size. `scale_grads=False` is meant for
  a sum loss; with a mean loss it gives M times the gradient. (Ours scales each loss by n_i / N.)
- Equal micro-batches only: a stage infers the shapes it receives from micro-batch 0, so a batch
  that M does not divide fails inside the step. We refuse it up front, on every rank.
- Its constructors refuse some (P, M): Schedule1F1B M < P; the interleaved ones an M whose rounds
  M // (M // P) do not divide it; DualPipeV M < 2P; ZBV and DualPipeV any v but 2.
- `schedule.pipeline_order`, the plan it prints, is not always what runs: for Schedule1F1B the last
  rank's plan reads F1 .. F_M. We record the order it *executes* by wrapping each stage's
  `forward_one_chunk`, `backward_one_chunk` and `backward_weight_one_chunk`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from distlab.model_split.partition import boundary_shapes, split_stages
from distlab.model_split.schedules import Action, looped, v_shape
from distlab.model_split.training import PipelineConfig, check_config, problem
from distlab.processes.identity import Runtime
from distlab.proof.timeline import Timeline

TORCH_SCHEDULES = {  # our name -> torch's class
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved-1f1b": "ScheduleInterleaved1F1B",
    "looped-bfs": "ScheduleLoopedBFS",
    "zb-h1": "ScheduleInterleavedZeroBubble",
    "interleaved-zb": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}
SINGLE_STAGE = ("gpipe", "1f1b")  # torch's PipelineScheduleSingle: one stage object, not a list
V_PLACED = ("zbv", "dualpipev")


def _as_actions(a) -> list[Action]:
    """torch's _Action as ours (F; I = its I, or its full backward B; W), an overlapped F+B as its two parts;
    communication and bookkeeping actions as nothing."""
    kinds = {"F": "F", "B": "I", "I": "I", "W": "W"}  # torch: B full backward, I input gradient
    if a is None:
        return []
    return [
        Action(kinds[s.computation_type.value], s.microbatch_index, s.stage_index)
        for s in (a.sub_actions or (a,))
        if s.computation_type.value in kinds
    ]


@contextmanager
def _recording(stages, log: list[Action]) -> Iterator[None]:
    """Log every forward, backward and weight gradient the schedule runs on these stages, in order.
    The wrappers hold the stages' bound methods, so they are removed on the way out: otherwise the
    cycle keeps each stage (and its buffers) alive until the next garbage collection."""
    names = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")

    def wrap(stage, name: str, kind: str):
        method = getattr(stage, name)

        def logged(chunk_id, *args, **kwargs):
            log.append(Action(kind, chunk_id, stage.stage_index))
            return method(chunk_id, *args, **kwargs)

        return logged

    for stage in stages:
        for name, kind in zip(names, "FIW"):
            setattr(stage, name, wrap(stage, name, kind))
    try:
        yield
    finally:
        for stage in stages:
            for name in names:
                delattr(stage, name)  # back to the class's methods


def _wrapped(rt: Runtime, cfg: PipelineConfig, stages: list):
    """This rank's stages as PipelineStages, placed as the schedule wants them (looped or V)."""
    from torch.distributed import pipelining  # a second of imports, only when used

    return [
        pipelining.PipelineStage(s.module.to(rt.device), s.index, cfg.stages_per_rank * rt.world_size, rt.device)
        for s in stages
    ]


def _schedule(cfg: PipelineConfig, wrapped: list, microbatches: int):
    """torch's schedule object; its constructor's checks raise ValueError on every rank alike."""
    from torch.distributed import pipelining

    if cfg.schedule not in TORCH_SCHEDULES:
        raise ValueError(f"unknown schedule {cfg.schedule!r}; choose one of {list(TORCH_SCHEDULES)}")
    schedule_class = getattr(pipelining, TORCH_SCHEDULES[cfg.schedule])
    return schedule_class(
        wrapped[0] if cfg.schedule in SINGLE_STAGE else wrapped,
        microbatches,
        loss_fn=F.mse_loss,
        scale_grads=cfg.scale_grads,
    )


def _my_stages(rt: Runtime, cfg: PipelineConfig, model) -> tuple[list, list]:
    every = split_stages(model, cfg.stages_per_rank * rt.world_size)
    placed = v_shape(rt.world_size) if cfg.schedule in V_PLACED else looped(rt.world_size, cfg.stages_per_rank)
    return every, [every[p] for p in placed[rt.rank]]


def refusals(rt: Runtime, cfg: PipelineConfig, microbatches: list[int]) -> dict[int, str]:
    """The M among `microbatches` that torch's constructor refuses for `cfg.schedule` at this P,
    with its message. Nothing runs and nothing is sent: the constructors only plan."""
    _, mine = _my_stages(rt, cfg, problem(cfg)[0])
    wrapped, refused = _wrapped(rt, cfg, mine), {}
    for m in microbatches:
        try:
            _schedule(cfg, wrapped, m)
        except ValueError as err:
            refused[m] = str(err)
    return refused


class TorchStep:
    """This rank's stages under torch.distributed.pipelining (a `training.Step`). `build`, if given,
    builds a one-stage-per-rank schedule instead of `_wrapped` and `_schedule` (lesson 04 writes it):
    build(module, p, P, device, name, M) -> (PipelineStage, schedule)."""

    def __init__(self, rt: Runtime, cfg: PipelineConfig, build: Callable | None = None):
        check_config(cfg)
        if cfg.global_batch % cfg.micro_batches:
            raise ValueError(
                f"torch.distributed.pipelining needs equal micro-batches: N={cfg.global_batch} "
                f"(--global-batch) does not split into M={cfg.micro_batches} (--micro-batches); "
                "it reuses micro-batch 0's shapes"
            )
        model, self.x, self.y = problem(cfg)
        every, self.stages = _my_stages(rt, cfg, model)
        boundary_shapes(every, tuple(self.x.shape), cfg.dtype)  # the same "does not fit" check as ours
        if build is None:
            self.wrapped = _wrapped(rt, cfg, self.stages)
            self.schedule = _schedule(cfg, self.wrapped, cfg.micro_batches)
        else:
            (only,) = self.stages
            stage, self.schedule = build(
                only.module.to(rt.device), only.index, rt.world_size, rt.device, cfg.schedule, cfg.micro_batches
            )
            self.wrapped = [stage]
        order = (self.schedule.pipeline_order or {}).get(rt.rank, [])
        self.planned = [x for a in order for x in _as_actions(a)]
        self.first, self.last = every[0] in self.stages, every[-1] in self.stages
        self.device, self.log, self.executed = rt.device, [], []
        self.timeline = Timeline(rt.rank, rt.device)

    def __call__(self, step: int) -> float | None:
        losses: list[torch.Tensor] = []
        args = (self.x.to(self.device),) if self.first else ()
        kwargs = dict(target=self.y.to(self.device), losses=losses) if self.last else {}
        self.log.clear()
        with _recording(self.wrapped, self.log):
            self.schedule.step(*args, **kwargs)
        if step == 0:
            self.executed = list(self.log)
        # Equal micro-batches: the batch mean is the mean of the micro-batch means.
        return torch.stack(losses).mean().item() if self.last else None

    def measurements(self) -> dict:
        return dict(executed=self.executed, planned=self.planned)
