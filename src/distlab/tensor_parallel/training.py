"""A few SGD steps of a (split or unsplit) block, the same loop for the reference and the ranks.

The loss is sum (z - t)^2 / (N seq d), a mean over the whole batch's elements: a rank that holds a part
of z (a sequence part, a data-parallel share) computes its share of that mean, and the shares add up to
the loss. `sync` runs after backward: nothing for tensor parallelism (the operators already made every
gradient whole), the sequence-cut parameters' all-reduce, a data-parallel all-reduce.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from distlab.compare import grads_of, params_of
from distlab.tensor_parallel.model import regression_loss


@dataclass(frozen=True)
class Batch:
    """What a model sees: its x, its target, the element count of the WHOLE batch, and each step's
    masks (its part of them; None: no dropout)."""

    x: torch.Tensor
    target: torch.Tensor
    count: int
    masks: list | None  # None: the model takes x alone (the MLP, attention)


@dataclass
class Run:
    first_output: torch.Tensor
    first_grads: dict[str, torch.Tensor]
    params: dict[str, torch.Tensor]
    losses: list[float]  # this model's share of each step's loss


def train(model: nn.Module, batch: Batch, steps: int, lr: float, sync: Callable[[], None] = lambda: None) -> Run:
    # One tensor at a time (foreach=False), as SGD does on the CPU by default: on CUDA its default is the
    # foreach kernels, which take all the parameters of a device in one call, and torch's tensor
    # parallelism leaves some of them plain tensors (the LayerNorms without sequence parallelism) beside
    # DTensors, a mix DTensor refuses ("got mixed torch.Tensor and DTensor").
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, foreach=False)
    losses, first = [], None
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        out = model(batch.x) if batch.masks is None else model(batch.x, batch.masks[step])
        loss = regression_loss(out, batch.target, batch.count)
        loss.backward()
        sync()
        losses.append(loss.item())
        if step == 0:  # the input's gradient too, when it has one (what the layer before would get)
            grads = grads_of(model) | ({"input": batch.x.grad.clone()} if batch.x.requires_grad else {})
            first = (out.detach().clone(), grads)
        optimizer.step()
    return Run(first[0], first[1], params_of(model), losses)
