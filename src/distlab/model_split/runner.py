"""Run a schedule: one rank executes its list of actions, for every stage it holds.

The batch of N rows is cut into M micro-batches of n_0 .. n_{M-1} rows (`torch.tensor_split`: the
first N mod M get one row more, so any N >= M works). On stage p (vP stages in all):

  F(p, i)  take micro-batch i (p = 0) or the activation stage p-1 produced, compute the stage, keep
           what the backward needs, hand the output to stage p+1. The last stage computes the loss.
  I(p, i)  the gradient of the stage's input, from the loss (p = vP-1) or from the gradient of its
           output that stage p+1 sent back; hand it to stage p-1. Unless the schedule has a W(p, i),
           the same backward also accumulates the parameters' gradients (`out.backward(g)`).
           Split: `torch.autograd.grad(out, x, g, retain_graph=True)`: the input's gradient only,
           keeping the graph for W.
  W(p, i)  `torch.autograd.backward(out, g, inputs=parameters)`: the parameters' gradients, later.
           The sum is the same as one backward's: each parameter's gradient is the same product of
           the same saved tensors, whichever call computes it. (Autograd walks the stage's graph
           twice to do it; the zero-bubble paper splits each layer's backward instead, and
           torch.distributed.pipelining keeps the intermediate gradients between the two calls.)

Messages between ranks follow `p2p.comm_plan`; two stages on one rank hand tensors over directly.
With `cfg.emulate_ms` > 0 every action runs on the emulated device (`distlab/proof/emulate.py`): the math,
then a sleep until the action has taken its fixed time (F, split I, W one unit per layer, unsplit I two).

The loss of a step is the mean over the whole batch. A micro-batch's loss l_i is a mean over its
n_i rows, and L = (1/N) sum_rows loss(row) = sum_i (n_i / N) l_i, so each l_i is scaled by n_i / N
before its backward; the accumulated gradients are exactly dL/dW, for uneven micro-batches too.
Backpropagating each l_i as it is trains on sum_i l_i, M times the mean for even micro-batches: an
M-times gradient that a loss curve hides and a gradient comparison does not. (PyTorch's schedules
instead divide the gradients by M after the step, `scale_grads=True`: exact only when every
micro-batch has the same size; lesson 04 shows it.)

Activation checkpointing (K >= 2): each stage runs `checkpoint_sequential(layers, K,
use_reentrant=False)`, which saves only the input of each of its first K-1 segments and reruns them
during backward. Its last segment always runs normally, so K = 1 would checkpoint nothing; K is
clamped to the stage's layer count.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint_sequential

from distlab.model_split import p2p
from distlab.model_split.partition import boundary_shapes, split_stages
from distlab.model_split.probe import StageProbe
from distlab.model_split.schedules import (
    Action,
    Schedule,
    check_schedule,
    make_schedule,
    placement,
    rank_of,
    split_backward,
)
from distlab.model_split.training import PipelineConfig, check_config, microbatch_sizes, problem
from distlab.processes.identity import Runtime
from distlab.proof.emulate import EmulatedDevice, action_units
from distlab.proof.timeline import Timeline


def stage_forward(module: nn.Sequential, x: torch.Tensor, segments: int) -> torch.Tensor:
    """The stage's forward, checkpointed in min(K, layers) segments when K >= 2."""
    k = min(segments, len(module))
    return checkpoint_sequential(module, k, x, use_reentrant=False) if k >= 2 else module(x)


class PipelineStep:
    """This rank's share of a schedule, ready to run one step at a time (a `training.Step`).
    Everything is validated on every rank from what every rank knows, before any message: bad
    input fails the same way everywhere instead of leaving some rank waiting in a receive."""

    def __init__(self, rt: Runtime, cfg: PipelineConfig, schedule: Schedule | None = None):
        check_config(cfg)
        if schedule is None:
            schedule = make_schedule(cfg.schedule, rt.world_size, cfg.micro_batches, cfg.stages_per_rank)
        if check_schedule(schedule) != cfg.micro_batches or len(schedule) != rt.world_size:
            raise ValueError(
                f"the schedule is for {len(schedule)} ranks and {check_schedule(schedule)} "
                f"micro-batches, not P={rt.world_size} and M={cfg.micro_batches}"
            )
        model, x, target = problem(cfg)
        every = split_stages(model, len(rank_of(schedule)))
        sizes = microbatch_sizes(cfg.global_batch, cfg.micro_batches)
        by_size = {n: boundary_shapes(every, (n, *x.shape[1:]), cfg.dtype) for n in set(sizes)}
        self.cfg, self.device, self.last = cfg, rt.device, len(every) - 1
        self.stages = [every[p] for p in placement(schedule)[rt.rank]]
        self.modules = {s.index: s.module.to(rt.device) for s in self.stages}
        self.actions, self.plan = schedule[rt.rank], p2p.comm_plan(schedule, rt.rank)
        self.split, self.where, self.rank = split_backward(schedule), rank_of(schedule), rt.rank
        # Each micro-batch its own tensor, as a data loader hands them over: what a forward saves of it
        # is its own rows (a view would keep the whole batch's storage, `distlab.proof.held`'s counting rule).
        self.x = [part.clone() for part in torch.tensor_split(x, cfg.micro_batches)]
        self.target = [part.clone() for part in torch.tensor_split(target, cfg.micro_batches)]
        self.shapes = [by_size[n] for n in sizes]  # uneven micro-batches: shapes differ in rows
        self.timeline, self.emulated = Timeline(rt.rank, rt.device), EmulatedDevice(cfg.emulate_ms)
        self.probe = StageProbe([s.module for s in self.stages]) if cfg.probe else None
        self.peak = self.layer_forwards = 0
        # With NCCL, a batch_isend_irecv that is the group's first collective must involve every rank,
        # and ours involve two. One collective of every rank first, on the device the batches will use
        # (on GPUs a CPU barrier would go to gloo and leave NCCL uninitialised), makes them legal subsets.
        dist.all_reduce(torch.zeros(1, device=rt.device))

    def __call__(self, step: int) -> float | None:
        self.held: dict[tuple[int, int], list] = {}  # (p, i) -> [input, output or loss, grad of output]
        self.inbox: dict[tuple[str, int, int], torch.Tensor] = {}
        self.outbox: dict[tuple[str, int, int], torch.Tensor] = {}
        self.loss = torch.zeros((), dtype=torch.float64)
        run = {"F": self._forward, "I": self._backward, "W": self._weight}
        for action, batch in zip(self.actions, self.plan):
            self._post(batch)
            units = action_units(
                action.kind, (action.stage, action.microbatch) in self.split, len(self.modules[action.stage])
            )
            with self.timeline.span(str(action), step), self.emulated.pad(units):
                run[action.kind](action)
        self._post(self.plan[-1])
        if step == 0 and self.probe:
            self.layer_forwards = self.probe.layer_forwards
        return self.loss.item() if self.last in self.modules else None

    def measurements(self) -> dict:
        probe = self.probe
        return dict(
            peak_in_flight=self.peak,
            saved_peak_bytes=probe.peak_bytes if probe else 0,
            layer_forwards=self.layer_forwards,
        )

    def _post(self, batch: list[p2p.Transfer]) -> None:
        """One batch of the plan: what this rank computed goes out, what peers computed comes in."""
        sends = [(self.outbox.pop(t.message), t.peer) for t in batch if t.op == "send"]
        recvs = [t for t in batch if t.op == "recv"]
        # An activation enters stage p: shapes[i][p]; a gradient is of stage p's output: [p + 1].
        got = p2p.exchange(
            sends,
            [(self.shapes[t.microbatch][t.stage + (t.what == "gradient")], t.peer) for t in recvs],
            self.cfg.dtype,
            self.device,
        )
        for t, tensor in zip(recvs, got):
            self.inbox[t.message] = tensor.requires_grad_(t.what == "activation")

    def _hand_on(self, what: str, stage: int, microbatch: int, tensor: torch.Tensor) -> None:
        """To a stage on another rank through the next batch; to one on this rank directly, cut
        from this stage's graph exactly as a message would be."""
        if self.where[stage] == self.rank:
            self.inbox[what, stage, microbatch] = tensor.detach().requires_grad_(what == "activation")
        else:
            self.outbox[what, stage, microbatch] = tensor

    def _forward(self, a: Action) -> None:
        p, i = a.stage, a.microbatch
        x = self.x[i].to(self.device) if p == 0 else self.inbox.pop(("activation", p, i))
        with self.probe.forward((p, i)) if self.probe else nullcontext():
            out = stage_forward(self.modules[p], x, self.cfg.checkpoint_segments)
            if p == self.last:
                out = F.mse_loss(out, self.target[i].to(self.device))
                if self.cfg.scale_loss:
                    out = out * (len(x) / self.cfg.global_batch)  # n_i / N: the whole batch's mean
                self.loss += out.detach().cpu()
        if p < self.last:
            self._hand_on("activation", p + 1, i, out)
        self.held[p, i] = [x, out, None]
        self.peak = max(self.peak, len(self.held))

    def _backward(self, a: Action) -> None:
        p, i = a.stage, a.microbatch
        x, out, _ = entry = self.held[p, i]
        grad = None if p == self.last else self.inbox.pop(("gradient", p, i))
        if (p, i) not in self.split:
            out.backward(grad)
            self._release(p, i)
            grad_x = x.grad
        elif p > 0:  # the first stage's input is data: no gradient to compute, W does it all
            (grad_x,) = torch.autograd.grad(out, x, grad, retain_graph=True)
        entry[2] = grad
        if p > 0:
            self._hand_on("gradient", p - 1, i, grad_x)

    def _weight(self, a: Action) -> None:
        _, out, grad = self.held[a.stage, a.microbatch]
        torch.autograd.backward(out, grad, inputs=list(self.modules[a.stage].parameters()))
        self._release(a.stage, a.microbatch)

    def _release(self, p: int, i: int) -> None:
        del self.held[p, i]
        if self.probe:
            self.probe.release((p, i))
