"""Each rank's share of the global batch: taking it, and checking that every rank holds one alike.

Rank r owns pairs r*C ... r*C + C - 1 of the global batch (C = N / P). The gathers and the local
loss assume every rank holds C x d embeddings of one shape and uses the same tau; a rank that does
not would hang the others in a gather or scramble the blocks, so `check_inputs` compares every
rank's shapes and tau in one small collective and raises the same ValueError on all of them.
"""

from __future__ import annotations

import torch

from distlab.comm.agree import rank_table
from distlab.processes.identity import Runtime


def local_block(t: torch.Tensor, rt: Runtime) -> torch.Tensor:
    """Rows r*C ... r*C + C - 1 of a global batch for rank r (C = N / P); P must divide N."""
    if len(t) % rt.world_size:
        raise ValueError(f"the global batch N = {len(t)} must split evenly over P = {rt.world_size} ranks")
    c = len(t) // rt.world_size
    return t[rt.rank * c : (rt.rank + 1) * c]


def check_inputs(z_x: torch.Tensor, z_y: torch.Tensor, tau: float) -> None:
    """Raise the same ValueError on every rank unless every rank holds C x d blocks of one shape
    for both towers and the same tau > 0.

    Each rank knows only its own tensors, so a local check could fail on one rank and leave the others
    waiting in the gather. Instead every rank shares (dims, shape of z_x, shape of z_y, tau) in one
    small all-gather of fixed size, and all ranks judge the same table.
    """
    slots = 4  # room for up to 3 dimensions per tensor: enough to report a wrong rank
    row = [-1.0] * (2 * slots + 1)
    for i, t in enumerate((z_x, z_y)):
        dims = list(t.shape)[: slots - 1]
        row[i * slots : i * slots + 1 + len(dims)] = [t.dim(), *dims]
    row[-1] = float(tau)
    table = rank_table(row, z_x.device)  # every rank judges the same table (distlab.comm.agree)

    def shape(row: torch.Tensor, i: int) -> tuple[int, ...]:
        ndim = int(row[i * slots])
        return tuple(int(v) for v in row[i * slots + 1 : i * slots + 1 + min(ndim, slots - 1)])

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
            f"size), got z_x {shapes_x}, z_y {shapes_y} (rank 0, 1, ...)"
        )
    if shapes_x[0][0] < 1:
        raise ValueError("every rank needs at least one pair (C >= 1)")
