"""A unit's parameters as one flat, padded buffer cut into P equal shards: the layout of every ZeRO stage.

A unit is one layer (one child of the model). Its Psi_u parameters, flattened in `named_parameters`
order, are padded with zeros to P * ceil(Psi_u / P) elements, so that the buffer splits into P equal
shards of ceil(Psi_u / P) elements, and rank r owns shard r.
Padding is what makes Psi_u not divisible by P work: reduce-scatter and all-gather need equal chunks;
the pad is zero in the parameters, zero in the gradients, so AdamW (with weight decay) keeps it zero.

One rank holds Psi_P = sum_u ceil(Psi_u / P) elements of every sharded item; Psi_P = Psi / P when P divides
every Psi_u, and a little more otherwise (at most one element per unit per rank).
"""

from __future__ import annotations

import math

import torch
from torch import nn


class FlatUnit:
    """One unit's layout: where each parameter sits in the flat buffer, and this rank's shard."""

    def __init__(self, module: nn.Module, rank: int, world_size: int, prefix: str = ""):
        named = list(module.named_parameters())
        self.names = [prefix + name for name, _ in named]
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


def units_of(model: nn.Module, rank: int, world_size: int) -> list[FlatUnit]:
    """One FlatUnit per child of the model (a layer), names as in `model.named_parameters()`."""
    return [FlatUnit(child, rank, world_size, f"{name}.") for name, child in model.named_children()]
