"""The DDP contrastive variants of lessons 21-23, each a loss and the gather it uses.

Every rank holds C = N / P pairs and its unit-norm embeddings z_x, z_y (C x d). A variant turns them
into (the loss this rank back-propagates, the global loss L as a detached number). DDP then
*averages* the parameter gradients over ranks,

    grad = 1/P * sum_r dLoss_r/dtheta   (what autograd on rank r finds through rank r's graph only),

and a variant is exact when grad = dL/dtheta, L = clip_loss(Z_x, Z_y) over all N pairs.

| variant          | loss on each rank                   | gather             | DDP gradient     |
|------------------|-------------------------------------|--------------------|------------------|
| `GLOBAL_PLAIN`   | `global_loss`: all N x N logits     | `gather_plain`     | dL/dtheta / P    |
| `GLOBAL_TIMES_P` | `global_loss_times_p`: backward P L | `gather_plain`     | exact            |
| `GLOBAL_SUM`     | `global_loss`                       | `gather_with_grad` | exact            |
| `LOCAL_PLAIN`    | `local_loss`: its C x N rows        | `gather_plain`     | wrong (lesson 22)|
| `LOCAL_SUM`      | `local_loss`                        | `gather_with_grad` | exact (lesson 23)|
| `LOCAL_LIBRARY`  | `local_loss`                        | `gather_library`   | exact (lesson 23)|

Why `GLOBAL_PLAIN` is 1/P: each rank computes the same L but back-propagates only through its own
block, so rank r finds g_r, the part of dL/dtheta that flows through its C samples, and
sum_r g_r = dL/dtheta; DDP's *average* of the g_r is 1/P of it. Why `LOCAL_PLAIN` is wrong:
L = 1/P sum_s L_s and rank r's embeddings appear in every L_s (as negatives in the other ranks'
rows), but rank r back-propagates only L_r: the terms dL_s/dz_r, s != r, are computed nowhere.

A variant does not validate its input; `distlab.contrastive.step.contrastive_loss` does, on every
rank at once, before the first gather.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from distlab.contrastive.gather import gather_library, gather_plain, gather_with_grad
from distlab.contrastive.losses import clip_loss, local_clip_loss
from distlab.processes.identity import Runtime

Gather = Callable[[torch.Tensor], torch.Tensor]  # this rank's C x d block -> the N x d concatenation
Losses = tuple[torch.Tensor, torch.Tensor]  # (loss to back-propagate, L detached)


def global_loss(rt: Runtime, z_x: torch.Tensor, z_y: torch.Tensor, tau: float, gather: Gather) -> Losses:
    """Every rank gathers both towers and computes the whole N x N loss: the same L everywhere."""
    loss = clip_loss(gather(z_x), gather(z_y), 1 / tau)
    return loss, loss.detach()


def global_loss_times_p(rt: Runtime, z_x: torch.Tensor, z_y: torch.Tensor, tau: float, gather: Gather) -> Losses:
    """`global_loss`, back-propagated as P * L: DDP's average of P copies is then the sum."""
    loss, value = global_loss(rt, z_x, z_y, tau, gather)
    return rt.world_size * loss, value


def local_loss(rt: Runtime, z_x: torch.Tensor, z_y: torch.Tensor, tau: float, gather: Gather) -> Losses:
    """This rank's C x N rows of S and of S^T, positives at columns rC + i: the local loss L_r.

    L is the mean of the P local losses (every rank holds C pairs): one all-reduce of one number.
    """
    rank_loss = local_clip_loss(z_x, z_y, gather(z_x), gather(z_y), 1 / tau, offset=rt.rank * len(z_x))
    total = rank_loss.detach().clone()  # on rt.device, like the embeddings
    dist.all_reduce(total)
    return rank_loss, total / rt.world_size


@dataclass(frozen=True)
class Variant:
    """One way to compute a DDP contrastive loss: `loss` with `gather` for the embeddings."""

    name: str  # as tables print it: short enough for an 80-column table
    loss: Callable[[Runtime, torch.Tensor, torch.Tensor, float, Gather], Losses]
    gather: Gather

    def __call__(self, rt: Runtime, z_x: torch.Tensor, z_y: torch.Tensor, tau: float) -> Losses:
        return self.loss(rt, z_x, z_y, tau, self.gather)


GLOBAL_PLAIN = Variant("plain", global_loss, gather_plain)
GLOBAL_TIMES_P = Variant("plain, P L", global_loss_times_p, gather_plain)
GLOBAL_SUM = Variant("sum-backward", global_loss, gather_with_grad)
LOCAL_PLAIN = Variant("plain", local_loss, gather_plain)
LOCAL_SUM = Variant("reduce_scatter", local_loss, gather_with_grad)
LOCAL_LIBRARY = Variant("torch", local_loss, gather_library)
