"""A unit's parameters as one flat, padded buffer cut into P equal shards: the layout of every ZeRO stage.

A unit is one layer (one child of the model) with the parameters it trains, or the root with those that
belong to no one child (`units_of`). Its Psi_u parameters, flattened in `named_parameters` order, are
padded with zeros to P * ceil(Psi_u / P) elements, so that the buffer splits into P equal
shards of ceil(Psi_u / P) elements, and rank r owns shard r.
Padding is what makes Psi_u not divisible by P work: reduce-scatter and all-gather need equal chunks;
the pad is zero in the parameters, zero in the gradients, so AdamW (with weight decay) keeps it zero.

One rank holds Psi_P = sum_u ceil(Psi_u / P) elements of every sharded item; Psi_P = Psi / P when P divides
every Psi_u, and a little more otherwise (at most one element per unit per rank).

Which parameters a unit holds (`units_of`), so that a real model's shapes train as in one process:

- only those that require grad: a frozen tower or a frozen bias is no unit's, never sharded, stepped or decayed;
- each tensor once: a weight tied across two children (GPT-2's embedding and output) is one parameter with one
  gradient (autograd sums its two uses), so it is flattened, reduced and stepped once;
- a parameter used by more than one child (a tied weight) or held by the model itself (CLIP's `logit_scale`)
  goes to the root's unit, the lowest module above every place it is used: ZeRO-3 gathers the root's unit
  when the model's forward starts and frees it when it ends, so the weight is whole wherever it is read
  (FSDP2 asks the same: a shared parameter in the group of a common ancestor).
"""

from __future__ import annotations

import math

import torch
from torch import nn


class FlatUnit:
    """One unit's layout: where each parameter sits in the flat buffer, and this rank's shard."""

    def __init__(self, params, rank: int, world_size: int, prefix: str = "", where: str = ""):
        """`params`: a module (all its parameters) or a list of (name, parameter) pairs; `where`: the name of
        the child whose forward uses them all ("" for the root: the model's whole forward)."""
        self.where = where
        named = list(params.named_parameters()) if isinstance(params, nn.Module) else list(params)
        self.names = [prefix + name for name, _ in named]
        self.params = [p for _, p in named]  # the tensors themselves: what a stage reads .grad of and writes
        self.shapes = [p.shape for _, p in named]
        self.sizes = [p.numel() for _, p in named]
        self.numel = sum(self.sizes)  # Psi_u
        self.shard_numel = math.ceil(self.numel / world_size)  # ceil(Psi_u / P)
        self.padded = self.shard_numel * world_size  # P ceil(Psi_u / P)
        self.rank = rank

    def flatten(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """The padded flat buffer (a new tensor) of `tensors` laid out like the parameters."""
        flat = torch.cat([t.reshape(-1) for t in tensors])
        return torch.cat([flat, flat.new_zeros(self.padded - self.numel)])

    def unflatten(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of `flat` (padded or not) shaped like the parameters."""
        return [piece.view(shape) for piece, shape in zip(flat[: self.numel].split(self.sizes), self.shapes)]

    def my_shard(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's ceil(Psi_u / P) elements of a padded flat buffer (a view)."""
        return flat[self.rank * self.shard_numel : (self.rank + 1) * self.shard_numel]

    def named(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """{parameter name: its view of the flat buffer}."""
        return dict(zip(self.names, self.unflatten(flat)))


def trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) of every parameter that requires grad, each tensor once (a tied one under the first
    name `named_parameters` gives it)."""
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]


def owner(model: nn.Module, param: nn.Parameter) -> str:
    """The child of `model` that alone holds `param` (its name), or "" (the root's): a parameter held by the
    model itself, or by several children (a tied weight)."""
    children = {
        name.split(".")[0] for name, p in model.named_parameters(remove_duplicate=False) if p is param and "." in name
    }
    held_by_root = any(p is param for p in model.parameters(recurse=False))
    return children.pop() if len(children) == 1 and not held_by_root else ""


def units_of(model: nn.Module, rank: int, world_size: int) -> list[FlatUnit]:
    """One FlatUnit per child of the model (a layer) with the trainable parameters it alone holds, in the
    children's order, then the root's unit (if any) with the rest; names as in `model.named_parameters()`.
    A plain stack of layers gives one unit per layer."""
    groups: dict[str, list[tuple[str, nn.Parameter]]] = {name: [] for name, _ in model.named_children()}
    groups[""] = []
    for name, p in trainable(model):
        groups[owner(model, p)].append((name, p))
    return [FlatUnit(named, rank, world_size, where=where) for where, named in groups.items() if named]
