"""Column- and row-parallel Linear: one rank's slice of an unsplit nn.Linear, y = x A^T + b.

Column parallel: A's rows (the outputs) cut in P contiguous chunks; rank r computes Y_r = X A_r^T + b_r,
its d_out / P columns of Y, from the WHOLE input X. Row parallel: A's columns (the inputs) cut the same
way; rank r computes X_r A_r^T from its d_in / P columns of X, a partial sum: Y = sum_r X_r A_r^T + b
needs one all-reduce, and b is added once, after it.

Column then row needs no communication in between: the column layer's output slice is exactly the row
layer's input slice (and an element-wise function such as GELU, or attention head by head, can sit
between them). `SPLIT` says along which dim each parameter is cut (None: replicated), so the unsplit
layer's gradients can be cut the same way to compare (`reference_shards`). A block is built from a pair of
layer kinds (`Layers`): these, or lesson 08's own, which the lesson proves equal to these.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


def _chunk(t: torch.Tensor, dim: int, rank: int, world_size: int) -> nn.Parameter:
    return nn.Parameter(t.detach().chunk(world_size, dim=dim)[rank].clone())


class ColumnParallelLinear(nn.Module):
    """Rank r's d_out / P outputs: weight (d_out/P, d_in), bias (d_out/P)."""

    SPLIT = {"weight": 0, "bias": 0}

    def __init__(self, full: nn.Linear, rank: int, world_size: int):
        super().__init__()
        self.weight = _chunk(full.weight, 0, rank, world_size)
        self.bias = _chunk(full.bias, 0, rank, world_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (..., d_in) whole -> (..., d_out / P)
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Rank r's d_in / P inputs: weight (d_out, d_in/P); the bias (d_out) whole, added after the sum."""

    SPLIT = {"weight": 1, "bias": None}

    def __init__(self, full: nn.Linear, rank: int, world_size: int):
        super().__init__()
        self.weight = _chunk(full.weight, 1, rank, world_size)
        self.bias = nn.Parameter(full.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (..., d_in / P) -> partial (..., d_out)
        return F.linear(x, self.weight)  # no bias: it belongs to the sum, not to each addend


@dataclass(frozen=True)
class Layers:
    """The two kinds of split Linear a block is built from: `column(full, rank, world_size)` and `row(...)`,
    each with a `SPLIT` dict (the dim each parameter is cut along; None: held whole)."""

    column: type = ColumnParallelLinear
    row: type = RowParallelLinear


LIBRARY_LAYERS = Layers()


def reference_shards(
    reference: dict[str, torch.Tensor], model: nn.Module, rank: int, world_size: int
) -> dict[str, torch.Tensor]:
    """The unsplit model's tensors (parameters or gradients, by name) cut as `model`'s parameters
    are: a parameter of a parallel layer gets its chunk, every other one the whole tensor."""
    out = {}
    for module_name, module in model.named_modules():
        for name, _ in module.named_parameters(recurse=False):
            full_name = f"{module_name}.{name}" if module_name else name
            dim = getattr(module, "SPLIT", {}).get(name)
            tensor = reference[full_name]
            out[full_name] = tensor if dim is None else tensor.chunk(world_size, dim=dim)[rank]
    return out
