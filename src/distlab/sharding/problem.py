"""The sharding lesson's problem: one model, a global batch per step, AdamW, one reference.

Every rank builds the same MLP (`layered_mlp`, one unit per layer) from the seed. Step t's global
batch of N rows depends on t alone (`global_batch`), so a run resumed at step t at any P sees the
batches an uninterrupted run sees; rank r trains on its C = N / P rows of it (`rows_of`).

The loss is the mean squared error, a MEAN OVER SAMPLES, so every sharded stage averages the
ranks' gradients (reduce-scatter, then divide by P) and must equal one process on the whole batch:
`adamw_reference` is that process, a deep copy of the model with torch's own AdamW (weight decay on
every parameter, one group), whose parameters and optimizer states every stage is compared with.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from distlab.compare import grads_of, params_of
from distlab.models import layered_mlp, regression_batch
from distlab.runtime import Runtime


@dataclass(frozen=True)
class ShardingConfig:
    widths: tuple[int, ...] = (16, 13, 11, 5)  # layer Psi_u = 221, 154, 60: no P in 2..4 divides all
    global_batch: int = 24  # N
    steps: int = 3
    lr: float = 0.01
    weight_decay: float = 0.1
    seed: int = 0
    dtype: torch.dtype = torch.float64


def build_model(cfg: ShardingConfig) -> nn.Sequential:
    return layered_mlp(cfg.widths, seed=cfg.seed, dtype=cfg.dtype)


def global_batch(cfg: ShardingConfig, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step `step`'s N rows (x, target), the same on every rank and at every P."""
    return regression_batch(cfg.global_batch, cfg.widths[0], cfg.widths[-1], seed=cfg.seed + 1 + step, dtype=cfg.dtype)


def rows_of(t: torch.Tensor, rt: Runtime) -> torch.Tensor:
    """This rank's C = N / P rows, a contiguous copy on its device."""
    c = t.shape[0] // rt.world_size
    return t[rt.rank * c : (rt.rank + 1) * c].clone().to(rt.device)


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target)  # a mean over the rows: the ranks' means average to the global mean


def adamw(params, cfg: ShardingConfig) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


@dataclass
class Trained:
    """Parameters, the last step's (averaged) gradients and AdamW's states ({"exp_avg", "exp_avg_sq",
    "step"}), by parameter name; the global loss of each step."""

    params: dict[str, torch.Tensor]
    grads: dict[str, torch.Tensor]
    states: dict[str, dict[str, torch.Tensor]]
    losses: list[float]


def optimizer_states(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, dict[str, torch.Tensor]]:
    """The optimizer's state of each of `model`'s parameters, by name, as plain CPU tensors."""
    return {
        name: {k: v.detach().cpu().clone() for k, v in optimizer.state[p].items()}
        for name, p in model.named_parameters()
    }


def adamw_reference(cfg: ShardingConfig, steps: int | None = None) -> Trained:
    """One process, the whole batch, plain autograd, torch's AdamW: the independent reference."""
    model = copy.deepcopy(build_model(cfg))
    optimizer = adamw(model.parameters(), cfg)
    losses = []
    for step in range(cfg.steps if steps is None else steps):
        x, target = global_batch(cfg, step)
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), target)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return Trained(params_of(model), grads_of(model), optimizer_states(model, optimizer), losses)
