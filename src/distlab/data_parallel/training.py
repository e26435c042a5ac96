"""One data-parallel training loop, whatever makes the gradients global.

Each rank runs forward and backward on its own C rows; `sync()` then turns the rank's gradients into
the global batch's (lesson 06's all-reduce loop, its gradient buckets, or nothing for a DDP model,
which syncs inside backward); then every rank takes the same SGD step. Every rank starts from the same
weights and applies the same averaged gradient, so the replicas stay identical without ever
exchanging parameters.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from distlab.compare import grads_of, params_of
from distlab.data_parallel.problem import DataParallelConfig, build, mean_loss, shard
from distlab.runtime import Runtime


@dataclass
class DataParallelRun:
    first_grads: dict[str, torch.Tensor]  # after the first step's sync
    params: dict[str, torch.Tensor]  # after the last step
    losses: list[float]  # global loss per step: the mean of the ranks' losses


def plain(model: nn.Module) -> nn.Module:
    """The module itself, under a DDP wrapper or not (so parameter names match the reference's)."""
    return getattr(model, "module", model)


def train(rt: Runtime, cfg: DataParallelConfig, model: nn.Module, sync: Callable[[], None]) -> DataParallelRun:
    """`cfg.steps` SGD steps of the mean loss on this rank's rows; `sync()` after each backward."""
    _, x, target = build(cfg)
    x, target = shard(x, rt), shard(target, rt)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    losses, first_grads = [], {}
    for step in range(cfg.steps):
        optimizer.zero_grad(set_to_none=True)
        loss = mean_loss(model(x), target)
        loss.backward()
        sync()
        losses.append(loss.detach())
        if step == 0:
            first_grads = grads_of(plain(model))
        optimizer.step()
    # Equal shares: the global mean loss is the mean of the ranks' means (one collective for all steps).
    every = torch.stack(losses).to(rt.device)
    dist.all_reduce(every)
    return DataParallelRun(first_grads, params_of(plain(model)), (every / rt.world_size).tolist())
