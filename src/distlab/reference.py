"""The independent reference every equivalence check compares against: a deep copy of the whole
model, trained on the whole batch in one process with plain autograd. No distribution, no
micro-batches, nothing shared with the code under test but the model's starting weights.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from distlab.compare import grads_of, params_of


@dataclass
class ReferenceRun:
    first_grads: dict[str, torch.Tensor]  # after the first backward
    params: dict[str, torch.Tensor]  # after the last step
    losses: list[float]


def sgd_reference(
    model: nn.Module,
    x: torch.Tensor,
    target: torch.Tensor,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    steps: int,
    lr: float,
) -> ReferenceRun:
    """`steps` full-batch SGD steps on a deep copy of `model` (the original is left untouched)."""
    model = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    losses, first_grads = [], {}
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), target)
        loss.backward()
        losses.append(loss.item())
        if step == 0:
            first_grads = grads_of(model)
        optimizer.step()
    return ReferenceRun(first_grads, params_of(model), losses)
