"""Exercise 10: global x global made exact by back-propagating P * L (read lessons/10_contrastive_global.py
first; check your answer with `pytest --exercises -k 10`).

Write `global_loss_times_p(rt, z_x, z_y, tau, gather)`: rank r holds its C x d blocks z_x, z_y of unit-norm
embeddings; `gather` (a plain all_gather that puts this rank's own block back with its graph) returns the
N x d concatenations. Every rank computes the whole symmetric InfoNCE L over all N pairs; return
(the loss this rank back-propagates, L detached).

Why P * L: rank r's backward reaches only its own block, so it finds g_r, the part of dL/dtheta that
flows through its C samples, and dL/dtheta = sum_r g_r. DDP AVERAGES the ranks' gradients:
1/P sum_r g_r = dL/dtheta / P. Back-propagating P * L instead makes the average the sum.

Hints:
- `distlab.contrastive.losses.clip_loss(Z_x, Z_y, 1 / tau)` is L on the gathered N x d embeddings (it
  takes the logit scale s = 1/tau);
- `rt.world_size` is P;
- report L, not P * L: the second value is for printing, detached.
"""

from __future__ import annotations

import torch

from distlab.runtime import Runtime


def global_loss_times_p(
    rt: Runtime, z_x: torch.Tensor, z_y: torch.Tensor, tau: float, gather
) -> tuple[torch.Tensor, torch.Tensor]:
    """(P * L to back-propagate, L detached), L the whole N x N loss over the gathered embeddings."""
    raise NotImplementedError(
        "not written yet: global_loss_times_p(rt, z_x, z_y, tau, gather), the whole "
        "loss L over gathered embeddings, back-propagated as P * L"
    )
