"""A pipeline stage whose parameters are DTensors, as a trainee of the one training loop.

Under the composition every parameter of a rank's stage is a DTensor on the mesh: sharded by FSDP2 over
the dp x cp ranks (`Shard(0)` of its rows) and, for the layers tensor parallelism cuts, over tp as well. The
loop (`distlab.proof.training.train`) reads gradients, parameters and AdamW's states by name to compare them with
one process's; `full_tensor()` gathers a DTensor whole on every rank of its mesh, and a rank holds only its
own stage's names. The gathers are collectives: every rank of a stage calls them in the same order (the
names' order), and a rank of another stage gathers its own names on its own groups at the same time.

The step itself is the caller's (the schedule); after its backward the gradients are already the global
batch's: the schedule divided them by M and FSDP2's reduce-scatter averaged them over dp x cp.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

Tensors = dict[str, torch.Tensor]


def whole(t: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered whole (a collective on its mesh); a plain tensor as it is. A CPU copy."""
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu().clone()


class MeshTrainee:
    """`model` (this rank's stage) stepped by `optimizer`; the step itself is the caller's (the schedule's)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def after_backward(self) -> None:
        pass  # the schedule scaled the gradients by 1/M, FSDP2 averaged them over dp x cp

    def after_step(self) -> None:
        pass

    def grads(self) -> Tensors:
        return {n: whole(p.grad) for n, p in self.model.named_parameters()}

    def params(self) -> Tensors:
        return {n: whole(p) for n, p in self.model.named_parameters()}

    def states(self) -> dict[str, Tensors]:
        """AdamW's exp_avg, exp_avg_sq and step of every parameter, by name, whole."""
        return {
            n: {k: whole(v) for k, v in sorted(self.optimizer.state[p].items())}
            for n, p in self.model.named_parameters()
        }


def flat_states(states: dict[str, Tensors]) -> Tensors:
    """{'layers.0.ln1.weight': {'exp_avg': ..}} -> {'layers.0.ln1.weight exp_avg': ..}, for `compare`."""
    return {f"{name} {key}": t for name, state in states.items() for key, t in state.items()}
