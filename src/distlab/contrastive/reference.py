"""Single-process references for the DDP contrastive steps: no process group, no gather.

- `full_batch_gradients`: a deep copy of the model on the whole global batch, plain autograd on
  `clip_loss`. Every exact variant of lessons 07 and 09 must reproduce it.
- `detached_blocks_gradients`: what lesson 08's plain gather really computes, written out in one
  process without any of its code: split the batch into P blocks; for block r, the symmetric loss
  over the rows of block r in which only block r's embeddings carry gradient (the other blocks are
  detached constants); average over r. Its gradient is

      1/P * sum_r  dL_r/dz_r * dz_r/dtheta,

  the true gradient 1/P * sum_r sum_s dL_s/dz_r * dz_r/dtheta minus the s != r terms.
- `replayed_reference`: the full batch through chosen towers in each rank's micro-batches, from each
  rank's dropout seed, so dropout draws the masks a chunked step drew (GradCache, lesson 10).
"""

from __future__ import annotations

import copy
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from distlab.compare import grads_of
from distlab.contrastive.losses import check_temperature, clip_loss


def full_batch_gradients(model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                         tau: float) -> tuple[float, dict[str, torch.Tensor]]:
    """(L, dL/dtheta) of a deep copy of `model` on the whole batch (the original is untouched)."""
    model = copy.deepcopy(model)
    model.zero_grad(set_to_none=True)
    loss = clip_loss(*model(x, y), tau)
    loss.backward()
    return loss.item(), grads_of(model)


def _only_block_carries_grad(z: torch.Tensor, rows: slice) -> torch.Tensor:
    """Same values as z; gradient flows only into z[rows]."""
    mask = torch.zeros(len(z), 1, dtype=z.dtype, device=z.device)
    mask[rows] = 1
    return z.detach() + mask * (z - z.detach())


def detached_blocks_loss(z_x: torch.Tensor, z_y: torch.Tensor, tau: float, world_size: int) -> torch.Tensor:
    """1/P * sum_r (block r's rows of the symmetric loss, every other block's embeddings detached).

    Its value is the global loss L; its gradient is what DDP with the plain gather computes.
    """
    check_temperature(tau)
    n = len(z_x)
    if n % world_size:
        raise ValueError(f"N = {n} must split evenly into {world_size} blocks")
    c = n // world_size
    labels = torch.arange(n, device=z_x.device)
    total = z_x.new_zeros(())
    for r in range(world_size):
        rows = slice(r * c, (r + 1) * c)
        zx_r, zy_r = _only_block_carries_grad(z_x, rows), _only_block_carries_grad(z_y, rows)
        s = zx_r @ zy_r.T / tau
        # Block r's rows of S (x -> y) and of S^T (y -> x), the mean over its C rows.
        total = total + (F.cross_entropy(s[rows], labels[rows]) + F.cross_entropy(s.T[rows], labels[rows])) / 2
    return total / world_size


def detached_blocks_gradients(model: nn.Module, x: torch.Tensor, y: torch.Tensor, tau: float,
                              world_size: int) -> tuple[float, dict[str, torch.Tensor]]:
    """(L, gradient of `detached_blocks_loss`) on a deep copy of `model` over the whole batch."""
    model = copy.deepcopy(model)
    model.zero_grad(set_to_none=True)
    loss = detached_blocks_loss(*model(x, y), tau, world_size)
    loss.backward()
    return loss.item(), grads_of(model)


def replayed_reference(model: nn.Module, towers: Sequence[str], inputs: Sequence[torch.Tensor],
                       world_size: int, micro_batch_size: int, loss_fn: Callable[..., torch.Tensor],
                       dropout_seed: int) -> tuple[float, dict[str, torch.Tensor]]:
    """(L, dL/dtheta) of plain autograd on a deep copy of `model`, one loss over the whole global batch,
    with dropout drawing the masks a chunked distributed step drew.

    `towers[k]` names the submodule that encodes `inputs[k]` (one name twice: a shared tower). Rank r
    owns rows r*C .. (r+1)*C - 1 of every input (C = N / P); its micro-batches of B rows run with a
    graph from `torch.manual_seed(dropout_seed + r)`, all of tower 0's, then all of tower 1's: the
    order in which GradCache (lesson 10) draws them in its first pass and replays them in its third.
    `loss_fn(*reps)` takes the towers' raw N x d outputs. Gradients are keyed by the names in `model`,
    for the towers used only. The caller's random stream is left as it was.
    """
    n = len(inputs[0])
    if n % world_size:
        raise ValueError(f"N = {n} must split evenly into {world_size} ranks")
    c, model = n // world_size, copy.deepcopy(model)
    model.zero_grad(set_to_none=True)
    reps: list[list[torch.Tensor]] = [[] for _ in towers]
    with torch.random.fork_rng(devices=[inputs[0].device.index] if inputs[0].is_cuda else []):
        for r in range(world_size):
            torch.manual_seed(dropout_seed + r)
            for k, (name, x) in enumerate(zip(towers, inputs)):
                tower, rows = model.get_submodule(name), x[r * c:(r + 1) * c]
                reps[k] += [tower(part) for part in rows.split(micro_batch_size)]
    loss = loss_fn(*(torch.cat(r) for r in reps))
    loss.backward()
    return loss.item(), {f"{name}.{key}": grad for name in dict.fromkeys(towers)
                         for key, grad in grads_of(model.get_submodule(name)).items()}
