"""The independent reference every equivalence check compares against: a deep copy of the whole
model, trained on the whole batch in one process with plain autograd. No distribution, no
micro-batches, nothing shared with the code under test but the model's starting weights and the
training loop itself (`distlab.proof.training.train`), which every run shares.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable

import torch
from torch import nn

from distlab.proof.training import Plain, Run, train

InputTarget = tuple[torch.Tensor, torch.Tensor]  # (x, target)


def sgd(lr: float) -> Callable[..., torch.optim.Optimizer]:
    """torch's plain SGD at `lr`, made from the parameters it steps."""
    return functools.partial(torch.optim.SGD, lr=lr)


def one_process(
    model: nn.Module,
    batch: Callable[[int], InputTarget],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    optimizer: Callable[..., torch.optim.Optimizer],
    steps: int,
    keep_states: bool = False,
) -> Run:
    """`steps` steps of a deep copy of `model` (the original is left untouched): step k trains on the
    whole batch `batch(k)` = (x, target), loss_fn(model(x), target).backward(), with
    `optimizer(parameters)` (torch's own SGD or AdamW); the optimizer's states kept if asked."""
    model = copy.deepcopy(model)

    def step(k: int) -> torch.Tensor:
        x, target = batch(k)
        loss = loss_fn(model(x), target)
        loss.backward()
        return loss

    return train(Plain(model, optimizer(model.parameters())), step, steps, keep_states)
