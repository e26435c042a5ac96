"""Cut an `nn.Sequential` into contiguous stages, one per rank, and derive the shapes at the cuts.

Balanced ceiling split: with L layers on P stages, the first L mod P stages get ceil(L/P) layers and
the rest floor(L/P). Seed 004's `layers_per_rank = ceil(L/P); start = rank * layers_per_rank` promises
exactly this ("the first ranks get one extra layer") but does not deliver it: for L=6, P=4 it gives
2, 2, 2, 0 and the last rank holds no layers at all. Here every stage gets at least one layer,
for every P from 1 to L.

No rank hard-codes another's shape: every rank holds the whole model (it is built from a seed), so
each derives the activation shape at every cut. Micro-batching already assumes that layers treat
samples independently (no statistics across the batch), so the batch dimension passes straight
through a stage, and a forward of an *empty* batch (zero rows: no arithmetic at all) gives every
other dimension. The same pass checks that a batch fits the model, identically on every rank and
before any message is sent. (The meta device would do too, but its first use costs a second of
imports on every rank.)
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Iterator

import torch
from torch import nn


def stage_bounds(num_layers: int, num_stages: int) -> list[range]:
    """The global layer indices of each stage: contiguous, non-empty, first stages one larger."""
    if num_stages < 1:
        raise ValueError(f"need at least one stage, got {num_stages}")
    if num_stages > num_layers:
        raise ValueError(
            f"more stages than layers: {num_stages} ranks for a model of {num_layers} layers would "
            f"leave {num_stages - num_layers} rank(s) with nothing to compute; use at most {num_layers} ranks"
        )
    base, extra = divmod(num_layers, num_stages)
    sizes = [base + (1 if s < extra else 0) for s in range(num_stages)]
    starts = list(itertools.accumulate(sizes, initial=0))
    return [range(starts[s], starts[s + 1]) for s in range(num_stages)]


@dataclass
class Stage:
    """One rank's share of the model: its index, the global layers it holds, and the module."""

    index: int
    layers: range
    module: nn.Sequential

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """Parameters under the unsplit model's names ('3.0.weight'), so they compare directly."""
        for local_name, param in self.module.named_parameters():
            i, rest = local_name.split(".", 1)
            yield f"{self.layers[int(i)]}.{rest}", param

    def grads(self) -> dict[str, torch.Tensor]:
        """CPU copies of this stage's gradients, under the unsplit model's names."""
        return {n: p.grad.detach().cpu().clone() for n, p in self.named_parameters()}

    def params(self) -> dict[str, torch.Tensor]:
        """CPU copies of this stage's parameters, under the unsplit model's names."""
        return {n: p.detach().cpu().clone() for n, p in self.named_parameters()}


def split_stages(model: nn.Sequential, num_stages: int) -> list[Stage]:
    """The stages of `model`. They share its layer modules (no copy): keep an independent
    reference with `copy.deepcopy(model)` *before* training the stages."""
    return [Stage(s, layers, nn.Sequential(*(model[i] for i in layers)))
            for s, layers in enumerate(stage_bounds(len(model), num_stages))]


@torch.no_grad()
def boundary_shapes(stages: list[Stage], batch_shape: tuple[int, ...],
                    dtype: torch.dtype) -> list[torch.Size]:
    """P + 1 shapes: shapes[s] enters stage s, shapes[P] leaves the last stage.

    Raises a ValueError naming the stage when a batch of `batch_shape` does not fit the model.
    """
    batch, *features = batch_shape
    device = next(stages[0].module.parameters()).device
    x = torch.empty((0, *features), dtype=dtype, device=device)
    shapes = [torch.Size(batch_shape)]
    for stage in stages:
        try:
            x = stage.module(x)
        except RuntimeError as err:
            raise ValueError(
                f"a batch of shape {tuple(batch_shape)} does not fit the model: stage {stage.index} "
                f"(layers {stage.layers.start}..{stage.layers.stop - 1}) cannot take an input of "
                f"shape {(batch, *x.shape[1:])}: {err}"
            ) from None
        shapes.append(torch.Size((batch, *x.shape[1:])))
    return shapes
