"""A short training run that shows what the load-balancing loss's statistics do: data whose ranks hold
different domains, the loop, and the measures of expert load.

The data. Rank r's C sequences come from domain r (as when a loader shards a corpus by source): tokens
x = mu_r + noise, with a mean mu_r of the domain, and a target x M_r, a map of the domain. An expert that
sees one domain has one linear map to learn; an expert that sees every domain has P of them. So the task
rewards experts that specialise by domain, which needs each rank's tokens to go to *some* experts, not
all of them.

The load-balancing loss decides whether that is allowed. With phi from the whole step's counts (global
statistics) it asks for the step's load to be even over the experts, and each rank may send its tokens
where it likes. With phi from each rank's own counts (local statistics, averaged over the ranks as DDP
does) it asks every rank's own load to be even, so every expert must serve every domain. Qiu et al.
(2025), "Demons in the Detail: On Implementing Load Balancing Loss for Training Specialized
Mixture-of-Expert Models" (https://arxiv.org/abs/2501.11873), find the same at scale: balancing within
each micro-batch (local) holds experts back from specialising and costs quality; balancing over the
global batch (the counts all-reduced across data-parallel ranks first) lets them specialise.

Measures, per step: the task loss (MSE, averaged over ranks) and L_aux, the step's load imbalance
max_i load_i / mean_i load_i over the E experts (1: even; E / kappa: all on kappa experts) and the same for
each rank's own tokens, averaged over ranks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from distlab.processes.identity import Runtime
from distlab.proof.training import mean_over_ranks

DOMAIN_SHIFT = 2.0  # |mu_r| ~ this times sqrt(d): domains the router can tell apart


def domain_batch(n: int, seq: int, dim: int, world: int, step: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, target), (N, seq, d) each, float64; sequences r C .. (r+1) C - 1 from domain r (C = N / P)."""
    gen = torch.Generator().manual_seed(seed)
    means = DOMAIN_SHIFT * torch.randn(world, dim, generator=gen, dtype=torch.float64)
    maps = torch.randn(world, dim, dim, generator=gen, dtype=torch.float64) / dim**0.5
    domain = torch.arange(n) // (n // world)
    gen = torch.Generator().manual_seed(seed * 100_003 + step + 1)  # a fresh batch every step
    x = torch.randn(n, seq, dim, generator=gen, dtype=torch.float64) + means[domain].unsqueeze(1)
    return x, torch.einsum("nsd,nde->nse", x, maps[domain])


def imbalance(load: torch.Tensor) -> float:
    """max over mean of a load per expert: 1 when even."""
    load = load.double()
    return (load.max() / load.mean()).item()


SERIES = ("task", "aux", "step_imbalance", "rank_imbalance")


@dataclass
class BalanceRun:
    """Per step: task loss and L_aux (means over ranks), the step's load imbalance, the ranks' own (mean)."""

    task: list[float]
    aux: list[float]
    step_imbalance: list[float]
    rank_imbalance: list[float]
    routed: list  # the last step's counts, P x E: tokens of rank s that chose expert i

    def tail(self, series: str, last: int) -> float:
        """The mean of a series over its last `last` steps (a step's batch is noisy, their mean is not)."""
        values = getattr(self, series)[-last:]
        return sum(values) / len(values)


@dataclass(frozen=True)
class Setup:
    """The run: N sequences of seq tokens of width d, `steps` AdamW steps at `lr`, alpha, the data's seed."""

    n: int
    seq: int
    dim: int
    steps: int
    lr: float
    aux_weight: float
    seed: int


def train_for_balance(
    rt: Runtime, block: nn.Module, counts: Callable[[], torch.Tensor], sync: Callable[[], None], setup: Setup
) -> BalanceRun:
    """`setup.steps` AdamW steps of `block` (forward(x) = (z, L_aux)) on this rank's share of
    `domain_batch`, loss MSE(z, target) + alpha L_aux; `counts()` returns the last forward's P x E routing
    counts, `sync()` makes the gradients the step's (run after backward)."""
    share = setup.n // rt.world_size
    rows = slice(rt.rank * share, (rt.rank + 1) * share)
    optimizer = torch.optim.AdamW(block.parameters(), lr=setup.lr, weight_decay=0.0)
    task, aux, step_load, rank_load = [], [], [], []
    for step in range(setup.steps):
        batch = domain_batch(setup.n, setup.seq, setup.dim, rt.world_size, step, setup.seed)
        x, target = (t[rows].to(rt.device) for t in batch)
        optimizer.zero_grad(set_to_none=True)
        z, balance = block(x)
        loss = F.mse_loss(z, target)
        (loss + setup.aux_weight * balance).backward()
        sync()
        optimizer.step()
        routed = counts().cpu()
        task.append(loss.item())
        aux.append(balance.item())
        step_load.append(imbalance(routed.sum(0)))
        rank_load.append(sum(imbalance(row) for row in routed) / len(routed))
    return BalanceRun(mean_over_ranks(task, rt), mean_over_ranks(aux, rt), step_load, rank_load, routed.tolist())
