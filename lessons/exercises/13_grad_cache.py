"""Exercise 13: GradCache's three steps (read lessons/13_grad_cache.py first; check your answer with
`pytest --exercises -k 13`).

Write `grad_cache_step(towers, inputs, b, loss_fn)`: the gradient of loss_fn(H_1, H_2, ...) over the whole
batch, where H_k = towers[k](inputs[k]) (n x d), while no tower ever runs with a graph on more than b rows:

    (1) no_grad: H_k = cat(tower_k(part) for each part of b rows)   remember each part's random state
    (2) L = loss_fn(H_1, H_2, ...) on detached leaves; backward:   G_k = dL/dH_k  (n x d)
    (3) each part again, with a graph and the SAME random state (dropout masks): backward of <h, G_k[part]>,
        which adds G . dh/dtheta = the part's share of dL/dtheta into .grad

Return L (detached). The parameter gradients accumulate into .grad, exactly those of plain autograd on the
whole batch with the masks step (1) drew.

Hints:
- `x.split(b)` cuts the rows into parts of at most b;
- `distlab.random_state.RandContext(part)` records the random state at construction and
  restores it inside `with`: make one before each forward of step (1), reuse it around step (3)'s;
- `torch.dot(h.flatten(), g.flatten()).backward()` back-propagates G through one part.
"""

from __future__ import annotations

import torch

from distlab.random_state import RandContext  # noqa: F401  (you will need it)


def grad_cache_step(towers, inputs, b: int, loss_fn) -> torch.Tensor:
    """GradCache's three steps; the parameter gradients of loss_fn(*reps) accumulate into .grad."""
    raise NotImplementedError(
        "not written yet: grad_cache_step(towers, inputs, b, loss_fn): (1) no-grad "
        "representations in parts of b rows with their random states, (2) the loss "
        "and G on detached leaves, (3) each part again under its random state, "
        "backward of <h, G>"
    )
