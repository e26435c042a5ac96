"""Cut an `nn.Sequential` into contiguous stages and derive the shapes at the cuts.

Balanced split: with `layers` layers in vP stages, the first (layers mod vP) stages get
ceil(layers / vP) layers and the rest floor(layers / vP). The tempting `per_rank = ceil(layers / vP);
start = p * per_rank` does not deliver that: 6 layers in 4 stages give 2, 2, 2, 0 layers, and the
last rank holds nothing. Here every stage gets at least one layer, for every stage count from 1 to `layers`.

A stage's module keeps the unsplit model's names ('3.0.weight' is layer 3 wherever it lives), so
`distlab.proof.compare.grads_of(stage.module)` compares with the reference directly.

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
from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import nn


def stage_bounds(num_layers: int, num_stages: int) -> list[range]:
    """The global layer indices of each stage: contiguous, non-empty, first stages one larger."""
    if num_stages < 1:
        raise ValueError(f"need at least one stage, got {num_stages}")
    if num_stages > num_layers:
        raise ValueError(
            f"more stages than layers: {num_stages} stages of a model of {num_layers} layers (--layers) "
            f"would leave {num_stages - num_layers} with nothing to compute; use at most {num_layers} "
            "stages (ranks times stages per rank)"
        )
    base, extra = divmod(num_layers, num_stages)
    sizes = [base + (1 if s < extra else 0) for s in range(num_stages)]
    starts = list(itertools.accumulate(sizes, initial=0))
    return [range(starts[s], starts[s + 1]) for s in range(num_stages)]


@dataclass
class Stage:
    """One stage of the model: its index p, the global layers it holds, and the module."""

    index: int
    layers: range
    module: nn.Sequential


def split_stages(model: nn.Sequential, num_stages: int) -> list[Stage]:
    """The stages of `model`. They share its layer modules (no copy): keep an independent
    reference with `copy.deepcopy(model)` *before* training the stages."""
    return [
        Stage(p, layers, nn.Sequential(OrderedDict((str(i), model[i]) for i in layers)))
        for p, layers in enumerate(stage_bounds(len(model), num_stages))
    ]


@torch.no_grad()
def boundary_shapes(stages: list[Stage], batch_shape: tuple[int, ...], dtype: torch.dtype) -> list[torch.Size]:
    """vP + 1 shapes: shapes[p] enters stage p, shapes[vP] leaves the last stage.

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
