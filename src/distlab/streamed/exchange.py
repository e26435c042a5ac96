"""How the ranks' embeddings meet: the gather (every rank holds N x 2d) or the ring (C x d blocks pass
rank to rank), and what each rank sends.

`EXCHANGE: "gather"` (the default) all-gathers z_x | z_y once; the InfoNCE loss then runs phases 2 and
3 of `step` per micro-batch, the sigmoid loss `sigmoid_gathered` (here) for the rank's C rows (its
rows and its columns: 4 C N d). `EXCHANGE: "ring"` never gathers: `ring.infonce_ring` (4 C N d) or
`ring.sigmoid_ring` (3 C N d) give this rank's C rows' G_x, G_y and its shares of dL/ds and dL/dbeta.
Either way the rank's shares of L are summed by one all-gather of P numbers (the same order on every
rank, so the same float everywhere).

`step_ledger` (a `distlab.comm.ledger.Ledger`) counts the bytes this rank hands to the network in one
step: point-to-point messages as sent, an all-gather of m bytes per rank as (P - 1) m (what each rank
sends in a ring all-gather). `expected_bytes` is the formula; per rank, with w the feature dtype's size
and c the compute dtype's (float32 or float64):

    gather, InfoNCE   (P - 1) (2 C d w + (2 C + 1) c)       (sharded normalisers; replicated: 2 C d w)
    gather, sigmoid   (P - 1) (2 C d w + c)
    ring, InfoNCE     c [(P - 1) C d + 2 P C + (P - 1)(C d + C) + P C d + (P - 1)]
    ring, sigmoid     c [(P - 1) C d + P C d + (P - 1)]
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from distlab.comm import compat
from distlab.comm.ledger import Ledger
from distlab.streamed.kernel_choice import as_tile_ops
from distlab.streamed.precision import pinned
from distlab.streamed.ring_passes import P2PRing, expected_ring_bytes, infonce_ring, sigmoid_ring
from distlab.streamed.sigmoid import Logits, RankGrads
from distlab.streamed.wrappers import compute_dtype

step_ledger = Ledger()  # what this rank sent in the current step (`step` clears it as a step begins)


def all_gather_counted(out: torch.Tensor, mine: torch.Tensor, group: Any, phase: str) -> None:
    """`mine` from every rank of `group` (None: the world) into `out`, in rank order; counted in
    `step_ledger` under `phase`."""
    compat.all_gather_single(out, mine, group=group)
    step_ledger.record(phase, "all_gather", out, group)


def expected_bytes(
    loss: str, exchange: str, shape: tuple[int, int, int], sizes: tuple[int, int], normalisers: str = "sharded"
) -> int:
    """The formula above: shape = (P, C, d), sizes = (w, c) in bytes."""
    (world, c, d), (w, comp) = shape, sizes
    if exchange == "ring":
        return expected_ring_bytes(world, c, d, comp, loss) + (world - 1) * comp
    extra = comp if loss == "sigmoid" else (2 * c + 1) * comp if normalisers == "sharded" else 0
    return (world - 1) * (2 * c * d * w + extra)


def gather_pairs(
    z_x: torch.Tensor, z_y: torch.Tensor, n: int, group: Any = None, upcast: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """All-gather this rank's C x d z_x, z_y over `group` (the wrapper's; None: the world) into N x d Z_x,
    Z_y in rank order: one collective for both (z_x | z_y side by side, in their own dtype when they share
    one; matmul reads the halves' row stride of 2d as is), upcast to the compute dtype after (`upcast`; the
    Triton kernels read bf16 and fp16 as they are)."""
    dtype = compute_dtype(z_x.dtype, z_y.dtype)
    wire = z_x.dtype if z_x.dtype == z_y.dtype else dtype
    mine = torch.cat((z_x.to(wire), z_y.to(wire)), dim=1)
    gathered = mine.new_empty((n, mine.shape[1]))
    all_gather_counted(gathered, mine, group, "embeddings")
    gathered = gathered.to(dtype) if upcast else gathered
    return gathered[:, : z_x.shape[1]], gathered[:, z_x.shape[1] :]


def summed_over_ranks(part: torch.Tensor, group: Any = None) -> float:
    """sum_r part_r, the same float on every rank (one all-gather of P numbers, summed in rank order)."""
    every = part.reshape(1).new_empty(dist.get_world_size(group))
    all_gather_counted(every, part.reshape(1), group, "loss")
    return every.sum().item()


def sigmoid_gathered(
    z_x: torch.Tensor, z_y: torch.Tensor, logits: Logits, own: slice, tiles, want_g_y: bool = True, want_grads=True
):
    """With the gathered N x d Z_x, Z_y: my rows against every column (loss, G_x, ds, db: 2 C N d),
    and every row against my columns (G_y: 2 C N d more). `tiles`: a `kernel_choice` TileOps, or T (the torch
    tiles of at most T x T). Without `want_grads` (a loss under torch.no_grad()): the loss and dL/dbeta's
    sum alone, S once (2 C N d; the Triton kernel makes D Z_y beside it anyway), no G."""
    n, s, tiles = len(z_x), logits.s, as_tile_ops(tiles)
    rows = tiles.sigmoid_block(z_x[own], z_y, logits, (own.start, 0), n, want=(want_grads, False))
    if not want_grads:
        return RankGrads(rows.loss_sum / n, None, None, None, rows.d_sum)
    g_s = (z_x[own] * rows.d_y).sum()
    g_y = None
    if want_g_y:
        g_y = tiles.sigmoid_block(z_x, z_y[own], logits, (0, own.start), n, want=(False, True)).d_x * s
    return RankGrads(rows.loss_sum / n, rows.d_y * s, g_y, g_s, rows.d_sum)


def rank_shares(
    z_x: torch.Tensor,
    z_y: torch.Tensor,
    logits: Logits | float,
    exchange: str,
    tiles,
    group: Any = None,
    want_grads: bool = True,
) -> tuple[RankGrads, float]:
    """This rank's C rows' (G_x, G_y, dL/ds share, dL/dbeta share) and the global L, from its own detached
    C x d embeddings: a `Logits` (s, beta) selects the sigmoid loss, a bare s the InfoNCE (ring only: the
    InfoNCE gather runs per micro-batch in `step`), over `group` (None: the world). `tiles` does the tile
    work (`kernel_choice`; an int T: the torch tiles) under its matmul precision, autocast off; sums in the
    compute dtype throughout. Without `want_grads` (a loss under torch.no_grad()) the gathered sigmoid loss
    computes no G (the ring's passes make L and G together: it computes them all)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    dtype, tiles = compute_dtype(z_x.dtype, z_y.dtype), as_tile_ops(tiles)
    with pinned(tiles.precision, z_x.device.type):
        if exchange == "ring":
            x, y = (tiles.prepare(z.to(dtype)).contiguous() for z in (z_x, z_y))
            ring = P2PRing(world, rank, group, step_ledger)
            shares = (
                sigmoid_ring(ring, x, y, logits, tiles)
                if isinstance(logits, Logits)
                else infonce_ring(ring, x, y, logits, tiles)
            )
        else:
            c = len(z_x)
            all_x, all_y = (tiles.prepare(z) for z in gather_pairs(z_x, z_y, c * world, group, upcast=False))
            if all_x.dtype != all_y.dtype:
                all_x, all_y = all_x.to(dtype), all_y.to(dtype)
            own = slice(rank * c, rank * c + c)
            shares = sigmoid_gathered(all_x, all_y, logits, own, tiles, want_grads=want_grads)
        return shares, summed_over_ranks(shares.loss_part, group)
