"""One DDP contrastive step, in every variant lessons 07-09 compare.

Every rank holds C = N / P pairs of the global batch, runs the DDP-wrapped two-tower model on them
and gets unit-norm embeddings z_x, z_y (C x d). DDP then *averages* parameter gradients over ranks:

    grad = 1/P * sum_r  dLoss_r/dtheta   (what autograd on rank r finds through rank r's graph only).

The global loss is L = clip_loss(Z_x, Z_y) over all N pairs. A variant is exact when grad = dL/dtheta.

| method                 | similarity       | gather backward          | DDP gradient            |
|------------------------|------------------|--------------------------|-------------------------|
| `global_plain`         | N x N, every rank | own slice of dL/dZ      | dL/dtheta / P (seed 003's CODE BLOCK 1) |
| `global_plain_xP`      | N x N, backward of P * L | own slice        | exact                   |
| `global_sum`           | N x N            | sum over ranks           | exact                   |
| `local_plain`          | C x N rows       | own slice of dL_r/dZ     | wrong (seed 003's CODE BLOCK 2, lesson 08) |
| `local_all_reduce`     | C x N rows       | all_reduce, own slice    | exact (the seed's fix)  |
| `local_reduce_scatter` | C x N rows       | reduce_scatter           | exact, half the traffic |
| `local_library`        | C x N rows       | torch's autograd gather  | exact                   |

Why `global_plain` is 1/P: each rank computes the same L but back-propagates only through its own
block, so rank r finds dL/dtheta restricted to its C samples, g_r, and sum_r g_r = dL/dtheta; DDP's
*average* of the g_r is therefore 1/P of it. Why `local_plain` is wrong: L = 1/P sum_s L_s and rank
r's embeddings appear in every L_s (as negatives in the other ranks' rows), but rank r only
back-propagates L_r: the terms dL_s/dz_r for s != r are never computed anywhere.

`contrastive_loss` validates its inputs on every rank at once (one small all-gather of shapes and
tau) before the first real collective, so bad input is the same ValueError everywhere, never a hang.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from distlab.compare import grads_of
from distlab.contrastive.gather import gather_library, gather_plain, gather_with_grad
from distlab.contrastive.losses import clip_loss, local_clip_loss
from distlab.models import TwoTower, paired_data
from distlab.runtime import Runtime

GLOBAL_METHODS = ("global_plain", "global_plain_xP", "global_sum")
LOCAL_METHODS = ("local_plain", "local_all_reduce", "local_reduce_scatter", "local_library")
METHODS = GLOBAL_METHODS + LOCAL_METHODS
EXACT_METHODS = ("global_plain_xP", "global_sum", "local_all_reduce", "local_reduce_scatter", "local_library")

_GATHERS = {
    "plain": gather_plain,
    "sum": lambda t: gather_with_grad(t, backward="reduce_scatter"),
    "all_reduce": lambda t: gather_with_grad(t, backward="all_reduce"),
    "reduce_scatter": lambda t: gather_with_grad(t, backward="reduce_scatter"),
    "library": gather_library,
}


def check_inputs(z_x: torch.Tensor, z_y: torch.Tensor, tau: float) -> None:
    """Raise the same ValueError on every rank unless every rank holds C x d blocks of one shape
    for both towers and the same tau > 0.

    Each rank knows only its own tensors, so a local check could fail on one rank and leave the others
    waiting in the gather. Instead every rank shares (dims, shape of z_x, shape of z_y, tau) in one
    small all-gather of fixed size, and all ranks judge the same table.
    """
    slots = 4  # room for up to 3 dimensions per tensor: enough to report a wrong rank
    meta = torch.full((2 * slots + 1,), -1.0, dtype=torch.float64, device=z_x.device)
    for i, t in enumerate((z_x, z_y)):
        meta[i * slots] = t.dim()
        dims = list(t.shape)[:slots - 1]
        meta[i * slots + 1:i * slots + 1 + len(dims)] = torch.tensor(dims, dtype=torch.float64)
    meta[-1] = float(tau)
    table = [torch.empty_like(meta) for _ in range(dist.get_world_size())]
    dist.all_gather(table, meta)

    def shape(row: torch.Tensor, i: int) -> tuple[int, ...]:
        ndim = int(row[i * slots])
        return tuple(int(v) for v in row[i * slots + 1:i * slots + 1 + min(ndim, slots - 1)])

    shapes_x = [shape(row, 0) for row in table]
    shapes_y = [shape(row, 1) for row in table]
    taus = [row[-1].item() for row in table]
    if not all(t > 0 for t in taus) or len(set(taus)) > 1:  # `t > 0` also rejects NaN
        raise ValueError(f"temperature tau must be > 0 and the same on every rank, got {taus} (rank 0, 1, ...)")
    if any(len(s) != 2 for s in shapes_x + shapes_y):
        raise ValueError(f"embeddings must be C x d matrices, got z_x {shapes_x}, z_y {shapes_y} (rank 0, 1, ...)")
    if len(set(shapes_x + shapes_y)) > 1:
        raise ValueError(
            f"every rank must hold z_x and z_y of one shape C x d (equal local batches, one embedding "
            f"size), got z_x {shapes_x}, z_y {shapes_y} (rank 0, 1, ...)")
    if shapes_x[0][0] < 1:
        raise ValueError("every rank needs at least one pair (C >= 1)")


def contrastive_loss(z_x: torch.Tensor, z_y: torch.Tensor, tau: float, method: str,
                     check: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(the loss this rank back-propagates, the global loss L as a detached value).

    `z_x`, `z_y` are this rank's C x d unit-norm embeddings; rank r owns pairs r*C ... r*C + C - 1.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if check:
        check_inputs(z_x, z_y, tau)
    similarity, gather_name = method.split("_", 1)
    scale = 1.0
    if gather_name == "plain_xP":
        gather_name, scale = "plain", float(dist.get_world_size())
    gather = _GATHERS[gather_name]
    all_z_x, all_z_y = gather(z_x), gather(z_y)
    if similarity == "global":
        # Every rank computes the same N x N loss: the value is L, the backward one is scale * L.
        loss = clip_loss(all_z_x, all_z_y, tau)
        return scale * loss, loss.detach()
    rank_loss = local_clip_loss(z_x, z_y, all_z_x, all_z_y, tau, offset=dist.get_rank() * len(z_x))
    # L = mean over ranks of the local losses (equal C everywhere): one all-reduce of one number.
    value = rank_loss.detach().clone()
    dist.all_reduce(value)
    return rank_loss, value / dist.get_world_size()


def ddp_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, tau: float, method: str) -> float:
    """Forward, loss, backward (DDP averages the gradients); returns the global loss L.

    The optimizer step and zero_grad are the caller's.
    """
    z_x, z_y = model(x, y)
    loss, value = contrastive_loss(z_x, z_y, tau, method)
    loss.backward()
    return value.item()


def local_block(t: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rows rank*C ... rank*C + C - 1 of a global batch (C = N / P); N must divide evenly."""
    if len(t) % world_size:
        raise ValueError(f"the global batch N = {len(t)} must split evenly over P = {world_size} ranks")
    c = len(t) // world_size
    return t[rank * c:(rank + 1) * c]


def ddp_gradients(model: nn.Module, x: torch.Tensor, y: torch.Tensor, tau: float,
                  method: str) -> tuple[float, dict[str, torch.Tensor]]:
    """(L, DDP-averaged gradients by parameter name) for this rank's local batch (x, y)."""
    model.zero_grad(set_to_none=True)
    loss = ddp_step(model, x, y, tau, method)
    inner = model.module if hasattr(model, "module") else model
    return loss, {n: g.cpu() for n, g in grads_of(inner).items()}


def first_step_gradients(rt: Runtime, methods: Sequence[str], batch_size: int, tau: float, seed: int = 0,
                         dtype: torch.dtype = torch.float64) -> dict[str, tuple[float, dict[str, torch.Tensor]]]:
    """Method -> (L, DDP gradients) for the first global batch: `TwoTower(seed)` wrapped in DDP,
    `paired_data(batch_size, seed)` split into the ranks' blocks. The single-process reference is
    `full_batch_gradients(TwoTower(seed), *paired_data(batch_size, seed), tau)`."""
    x, y = paired_data(batch_size, seed=seed, dtype=dtype)
    x, y = local_block(x, rt.rank, rt.world_size), local_block(y, rt.rank, rt.world_size)
    model = TwoTower(seed=seed, dtype=dtype).to(rt.device)
    ddp = DistributedDataParallel(model, device_ids=[rt.device] if rt.device.type == "cuda" else None)
    return {m: ddp_gradients(ddp, x.to(rt.device), y.to(rt.device), tau, m) for m in methods}
