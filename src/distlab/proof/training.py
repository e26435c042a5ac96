"""One training loop and one record of what it leaves: what every equivalence check trains and compares.

    for k in range(steps):
        trainee.zero_grad()
        loss_k = step(k)               forward and backward of step k's batch (this rank's share of it)
        trainee.after_backward()       make the gradients the global batch's (nothing in one process)
        k = 0: first_grads = trainee.grads()
        trainee.optimizer.step()
        trainee.after_step()           (ZeRO-1/2: all-gather the stepped shards into the weights)
    params = trainee.params(), and the optimizer's states where a lesson checks them

The single-process reference (`distlab.proof.reference.one_process`), a data-parallel replica, a tensor-parallel
rank, every strategy of lesson 07 and every pipeline schedule run this loop. What differs is only `step`
(which rows, which forward, which loss) and the trainee: how the gradients become global and where the
tensors are read. `Plain` is the trainee of a module whose parameters this rank holds as they are; the
sharded strategies of lesson 07 hold them in shards, and read them whole (gathered) for the record.

The record (`Run`) keeps step 1's gradients (a wrong gradient is wrong from the first step, before an
optimizer can hide its scale), the parameters after the last step, each step's loss and, where asked, the
optimizer's states, all as CPU copies under the unsplit model's parameter names, so that a run compares
with the reference name by name (`distlab.proof.compare`) and can be sent between ranks as it is.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from distlab.processes.identity import Runtime
from distlab.proof.compare import grads_of, params_of

Tensors = dict[str, torch.Tensor]


@dataclass
class Run:
    """What a few training steps leave to compare, by parameter name (CPU copies)."""

    first_grads: Tensors  # after step 1's backward and sync, before its optimizer step
    params: Tensors  # after the last step
    losses: list[float]  # each step's loss (a rank's share, until its caller makes it global)
    states: dict[str, Tensors] = field(default_factory=dict)  # the optimizer's, where a lesson checks them
    first_output: torch.Tensor | None = None  # step 1's output, where a lesson compares a split layer's


class Trainee(Protocol):
    """What the loop needs from whatever is trained: a plain module, a DDP replica, lesson 07's shards."""

    optimizer: torch.optim.Optimizer

    def zero_grad(self) -> None: ...

    def after_backward(self) -> None: ...

    def after_step(self) -> None: ...

    def grads(self) -> Tensors: ...

    def params(self) -> Tensors: ...

    def states(self) -> dict[str, Tensors]: ...


def _nothing() -> None:
    pass


class Plain:
    """A module whose parameters this rank holds as they are (the reference's, a replica's, a tensor-
    parallel rank's slices), stepped by `optimizer`; `after_backward` is the sync (None: one process)."""

    def __init__(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, after_backward: Callable[[], None] | None = None
    ):
        self.model, self.optimizer = model, optimizer
        self.sync = after_backward or _nothing

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def after_backward(self) -> None:
        self.sync()

    def after_step(self) -> None:
        pass

    def grads(self) -> Tensors:
        return grads_of(self.model)

    def params(self) -> Tensors:
        return params_of(self.model)

    def states(self) -> dict[str, Tensors]:
        return optimizer_states(self.model, self.optimizer)


def optimizer_states(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Tensors]:
    """The optimizer's state of each of `model`'s parameters, by name (AdamW: exp_avg, exp_avg_sq, step)."""
    return {
        name: {k: v.detach().clone() for k, v in optimizer.state[p].items()} for name, p in model.named_parameters()
    }


def train(
    trainee: Trainee, step: Callable[[int], torch.Tensor | float | None], steps: int, keep_states: bool = False
) -> Run:
    """`steps` steps of the loop above; `step(k)` returns step k's loss (None where this rank has none:
    a pipeline rank without the last stage). The loss is kept as a float at the end of its step, so no
    tensor of a step outlives it (lesson 07 measures what a step leaves behind)."""
    losses, first_grads = [], {}
    for k in range(steps):
        trainee.zero_grad()
        loss = step(k)
        trainee.after_backward()
        if k == 0:
            first_grads = _on_cpu(trainee.grads())
        trainee.optimizer.step()
        trainee.after_step()
        if loss is not None:
            losses.append(loss.item() if isinstance(loss, torch.Tensor) else loss)
        del loss  # the step's last tensor: nothing of it outlives the step
    states = {name: _on_cpu(s) for name, s in trainee.states().items()} if keep_states else {}
    return Run(first_grads, _on_cpu(trainee.params()), losses, states)


def reduce_gradients(params: list[nn.Parameter], all_reduce: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """A sync in one message: every gradient flattened into one buffer, `all_reduce` of it (a tensor in,
    the reduced tensor out: sum, or mean), the result copied back into the gradients."""
    flat = all_reduce(torch.cat([p.grad.reshape(-1) for p in params]))
    for p, g in zip(params, flat.split([p.numel() for p in params])):
        p.grad.copy_(g.view_as(p))


def _on_cpu(tensors: Tensors) -> Tensors:
    return {name: t.cpu() for name, t in tensors.items()}


def mean_over_ranks(values: list[float], rt: Runtime) -> list[float]:
    """Each value's mean over the ranks, in one collective on the rank's device: with equal shares of the
    batch, the global mean loss of a step is the mean of the ranks' means."""
    every = torch.tensor(values, dtype=torch.float64, device=rt.device)
    dist.all_reduce(every)
    return (every / rt.world_size).tolist()
