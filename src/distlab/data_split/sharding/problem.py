"""The sharding lesson's problem: one model, a global batch per step, AdamW, one reference.

Every rank builds the same MLP (`layered_mlp`, one unit per layer) from the seed. Step t's global
batch of N rows depends on t alone (`global_batch`), so a run resumed at step t at any P sees the
batches an uninterrupted run sees; rank r trains on its C = N / P rows of it (`rows_of`).

The loss is the mean squared error, a MEAN OVER SAMPLES, so every sharded stage averages the
ranks' gradients (reduce-scatter, then divide by P) and must equal one process on the whole batch:
`reference` is that process, a deep copy of the model with torch's own AdamW (weight decay on every
parameter, one group), whose gradients, parameters and optimizer states every stage is compared with.
Under mixed precision (`ShardingConfig.mixed`: bf16 model and batches, a float32 master that AdamW steps)
the reference is the same process under the same recipe (`distlab.data_split.sharding.mixed.MasterStepped`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from distlab.data_split.sharding.mixed import MasterStepped
from distlab.processes.identity import Runtime
from distlab.proof.models import RealShapes, layered_mlp, regression_batch
from distlab.proof.reference import one_process
from distlab.proof.training import Run, train


@dataclass(frozen=True)
class ShardingConfig:
    widths: tuple[int, ...] = (16, 13, 11, 5)  # layer Psi_u = 221, 154, 60: no P in 2..4 divides all
    global_batch: int = 24  # N
    steps: int = 3
    lr: float = 0.01
    weight_decay: float = 0.1
    seed: int = 0
    dtype: torch.dtype = torch.float64  # the model's weights, gradients and batches
    master: torch.dtype | None = None  # what AdamW steps and keeps its moments in, when not `dtype`
    # The optimizer, made from the tensors it steps (functools.partial(torch.optim.SGD, lr=..., momentum=...));
    # None: torch's AdamW at `lr` and `weight_decay`, the lesson's.
    optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer] | None = None
    # ZeRO-3 and FSDP2: the dtype the weights are gathered and computed in (bf16), while the shards they step
    # (the master weights) and the reduced gradients stay in `dtype` (FSDP2's MixedPrecisionPolicy); None: `dtype`.
    compute: torch.dtype | None = None
    # True: `distlab.proof.models.RealShapes` (V = widths[0] = widths[-1], d = widths[1]; a root parameter, a tied
    # embedding and output, a frozen tower and bias) instead of the MLP: the shapes a stage must handle.
    real_shapes: bool = False

    def mixed(self) -> ShardingConfig:
        """The same problem under mixed precision: bf16 weights, gradients and batches, a float32 master."""
        return replace(self, dtype=torch.bfloat16, master=torch.float32)


def build_model(cfg: ShardingConfig) -> nn.Module:
    if cfg.real_shapes:
        return RealShapes(cfg.widths[0], cfg.widths[1], cfg.seed, cfg.dtype, without=("unused",))
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


def optimizer_of(params, cfg: ShardingConfig) -> torch.optim.Optimizer:
    """The problem's optimizer over `params`: `cfg.optimizer` if given, else torch's AdamW (lr, weight decay)."""
    if cfg.optimizer is not None:
        return cfg.optimizer(list(params))
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


def reference(cfg: ShardingConfig, steps: int | None = None) -> Run:
    """One process, the whole batch of each step, plain autograd, torch's AdamW: the independent
    reference (`distlab.proof.reference.one_process`), its AdamW states kept; under mixed precision the
    bf16 model whose float32 master AdamW steps (`MasterStepped`)."""
    steps = cfg.steps if steps is None else steps
    if cfg.master is not None:
        model = build_model(cfg)  # a fresh model from the seed, the strategies' starting weights

        def step(k: int) -> torch.Tensor:
            x, target = global_batch(cfg, k)
            loss = loss_fn(model(x), target)
            loss.backward()
            return loss

        return train(MasterStepped(model, cfg.master, lambda params: optimizer_of(params, cfg)), step, steps, True)
    return one_process(
        build_model(cfg),
        lambda k: global_batch(cfg, k),
        loss_fn,
        lambda params: optimizer_of(params, cfg),
        steps,
        keep_states=True,
    )
