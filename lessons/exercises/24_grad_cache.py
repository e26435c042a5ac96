"""Exercise 24: GradCache's three steps (read lessons/24_grad_cache.py first; check your answer with
`pytest --exercises -k 24`; add `--hint-level 1`, 2 or 3 for help).

Write `grad_cache_step(towers, inputs, b, loss_fn)`: add into .grad the gradient of loss_fn(H_1, H_2, ...)
over the whole batch, where H_k = towers[k](inputs[k]) (n x d), and return L (detached), while no tower
ever runs with a graph on more than b rows at once.

The math. The parameters theta reach the loss only through the representations, so

    dL/dtheta = sum_k sum_i (dL/dh_k,i) . (dh_k,i/dtheta) = sum_k sum_parts d<H_k[part], G_k[part]>/dtheta,
    G_k = dL/dH_k  (n x d, computed once, on all n rows: the loss couples every pair),

and a part's representations can be recomputed, with a graph, just before their backward. The recompute must
be the same function as the first forward: the same dropout masks.

The judge runs your step with dropout off and on, compares the loss and every parameter's gradient with
plain autograd on the whole batch under the masks your first pass drew (float64; parts of b = 3 rows that
do not divide n = 10), sees which rows of G each part's backward is given, and counts, with forward hooks, the
rows each tower runs with a graph: at most b at a time, each row once.

What you have: `distlab.pieces.random_state.RandContext` records a random state and restores it.
"""

from __future__ import annotations

import torch

from distlab.pieces.random_state import RandContext  # noqa: F401  (you will need it)


def grad_cache_step(towers, inputs, b: int, loss_fn) -> torch.Tensor:
    """GradCache's three steps; the parameter gradients of loss_fn(*reps) accumulate into .grad."""
    raise NotImplementedError("not written yet: grad_cache_step(towers, inputs, b, loss_fn)")
