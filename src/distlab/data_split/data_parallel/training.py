"""Data-parallel training on the one loop (`distlab.proof.training.train`), whatever makes the gradients global.

Each rank runs forward and backward on its own C rows; `sync()` then turns the rank's gradients into
the global batch's (lesson 06's all-reduce loop, its gradient buckets, or nothing for a DDP model,
which syncs inside backward); then every rank takes the same SGD step. Every rank starts from the same
weights and applies the same averaged gradient, so the replicas stay identical without ever
exchanging parameters.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from distlab.data_split.data_parallel.problem import DataParallelConfig, build, mean_loss, shard
from distlab.processes.identity import Runtime
from distlab.proof.training import Plain, Run, mean_over_ranks
from distlab.proof.training import train as train_loop


def plain(model: nn.Module) -> nn.Module:
    """The module itself, under a DDP wrapper or not (so parameter names match the reference's)."""
    return getattr(model, "module", model)


def train(rt: Runtime, cfg: DataParallelConfig, model: nn.Module, sync: Callable[[], None]) -> Run:
    """`cfg.steps` SGD steps of the mean loss on this rank's rows; `sync()` after each backward. The
    losses are the global batch's: with equal shares, the mean of the ranks' means."""
    _, x, target = build(cfg)
    x, target = shard(x, rt), shard(target, rt)

    def step(k: int) -> torch.Tensor:
        loss = mean_loss(model(x), target)
        loss.backward()
        return loss

    run = train_loop(Plain(plain(model), torch.optim.SGD(model.parameters(), lr=cfg.lr), sync), step, cfg.steps)
    run.losses = mean_over_ranks(run.losses, rt)
    return run
