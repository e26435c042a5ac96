"""The data-parallel problem of lesson 06: one model, one global batch, two losses, one reference.

Every rank builds the same model (`layered_mlp`) and the same global batch of N rows from the seed,
and keeps its own C = N / P rows (`shard`). Two losses, the distinction the lesson is about:

- `mean_loss`: the mean squared error, a MEAN OVER SAMPLES. Rank r's loss over its C rows is
  L_r = 1/C sum_{i in r} l_i, and the global loss is L = 1/N sum_i l_i = 1/P sum_r L_r. So the
  average of the ranks' gradients is the global gradient: averaging is exactly right.
- `batch_lse_loss`: L = mean over output columns j of log sum_i exp(y_ij), a log-sum-exp over the
  rows of the whole batch, as in the contrastive losses (every row's term has every other row in it).
  It does not split into per-rank parts; each rank all-gathers the N outputs (`gather_rows`) and
  computes the same global L. Then rank r's backward finds g_r, the part of dL/dtheta that flows
  through its own rows, dL/dtheta = sum_r g_r, and averaging gives dL/dtheta / P.

The reference for both is `distlab.proof.reference.one_process`: a deep copy of the model, run on the
whole batch in one process with plain autograd.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from distlab.comm import compat
from distlab.processes.flags import p_divides_n, require
from distlab.processes.identity import Runtime
from distlab.proof.models import layered_mlp, mlp_widths, regression_batch


@dataclass(frozen=True)
class DataParallelConfig:
    global_batch: int = 48  # N
    layers: int = 4
    width: int = 32
    steps: int = 3  # SGD steps
    lr: float = 0.1
    seed: int = 0
    dtype: torch.dtype = torch.float64

    @property
    def widths(self) -> tuple[int, ...]:
        return mlp_widths(self.layers, self.width)


def check_config(rt: Runtime, cfg: DataParallelConfig) -> None:
    """The same ValueError on every rank, before any collective."""
    p_divides_n(cfg.global_batch, rt.world_size)  # unequal shares: the mean of the ranks' means is not N's


def world_rules(global_batch: int, accumulation_steps: int, world_size: int) -> None:
    """Lesson 06's flag checks that need P, run before any output (`flags.check_flags_against_world`): P
    divides N, and the no_sync part cuts each rank's C rows into at most C micro-batches."""
    p_divides_n(global_batch, world_size)
    require(
        accumulation_steps <= global_batch // world_size,
        "--accumulation-steps",
        f"at most C = N / P = {global_batch // world_size} micro-batches per rank",
    )


def build(cfg: DataParallelConfig) -> tuple[nn.Sequential, torch.Tensor, torch.Tensor]:
    """(model, x, target) of the whole global batch, identical on every rank, on the CPU."""
    model = layered_mlp(cfg.widths, seed=cfg.seed, dtype=cfg.dtype)
    x, target = regression_batch(cfg.global_batch, cfg.widths[0], cfg.widths[-1], seed=cfg.seed + 1, dtype=cfg.dtype)
    return model, x, target


def shard(t: torch.Tensor, rt: Runtime) -> torch.Tensor:
    """This rank's C = N / P rows, on its device."""
    c = t.shape[0] // rt.world_size
    return t[rt.rank * c : (rt.rank + 1) * c].to(rt.device)


def mean_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target)  # mean over rows (and columns)


def batch_lse_loss(out: torch.Tensor, target: torch.Tensor | None = None) -> torch.Tensor:
    return torch.logsumexp(out, dim=0).mean()  # over the rows of the whole batch: no per-row split


def gather_rows(y: torch.Tensor, rt: Runtime) -> torch.Tensor:
    """All N rows on every rank, rank order. `all_gather` carries no gradient, so this rank's own
    block is put back with its graph: backward reaches only this rank's rows."""
    every = y.new_empty((rt.world_size * y.shape[0], *y.shape[1:]))
    compat.all_gather_single(every, y.detach().contiguous())
    blocks = list(every.chunk(rt.world_size))
    blocks[rt.rank] = y
    return torch.cat(blocks)
