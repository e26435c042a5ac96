"""Exercise 21: global x global made exact by back-propagating P * L (read lessons/21_contrastive_global.py
first; check your answer with `pytest --exercises -k 21`; add `--hint-level 1`, 2 or 3 for help).

Rank r holds its C x d blocks z_x, z_y of unit-norm embeddings; `gather(z)` returns the N x d concatenation
of every rank's block in rank order, this rank's own block with its graph, the others as plain numbers.
Every rank computes the whole symmetric InfoNCE over all N pairs,

    S = Z_x Z_y^T / tau,    L = 1/(2N) sum_i [ -log softmax(S[i, :])_i - log softmax(S[:, i])_i ],

and the model under DDP then averages the ranks' parameter gradients. Write `global_loss_times_p`: return
(the loss this rank back-propagates, L detached for printing), so that after DDP's average every parameter
holds exactly dL/dtheta.

The catch: rank r's backward reaches only its own block, so it finds g_r, the part of dL/dtheta that flows
through its C samples, and dL/dtheta = sum_r g_r. What does DDP's average of the g_r give, and what must
each rank back-propagate instead? The judge checks the reported loss against one process and the gradient
reaching z_x against P times the full batch's (float64).

What you have: `rt.world_size` is P; `distlab.contrastive.losses` holds the lesson's losses.
"""

from __future__ import annotations

import torch

from distlab.processes.identity import Runtime


def global_loss_times_p(
    rt: Runtime, z_x: torch.Tensor, z_y: torch.Tensor, tau: float, gather
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the loss this rank back-propagates, L detached), L the whole loss over the gathered embeddings."""
    raise NotImplementedError("not written yet: global_loss_times_p(rt, z_x, z_y, tau, gather)")
