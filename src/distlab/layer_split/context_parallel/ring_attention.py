"""Ring attention as a library piece: lesson 09's ring, forward and backward, for a model to call.

Lesson 09 writes the ring out (its `ring_forward`, `ring_backward`, `RingAttention`) and proves it equal to
`scaled_dot_product_attention` on the whole sequence; this is the same loop without the lesson's tallies,
for a model whose attention runs under context parallelism (lesson 12's transformer, where the ring is one
dimension of a mesh: its group is the mesh's cp group). tests/test_context_parallel_ring.py proves it equal
to the lesson's, bit for bit.

Rank r of the ring holds the query rows `layout.pieces(r)` (any leading dims: (N, heads, seq/P, d_h)).
Forward: P steps; in step i it folds the key/value block of rank r - i into running (max, sum, out) per
query row (`attention.fold_tile`), the next block's shift posted before the math. Backward: the blocks go
round again with their gradient accumulators (dk, dv), and every rank adds its tiles' contributions
(`attention.tile_grads`, from the saved log-sum-exp); after P moves the accumulators are home.

`ring_core(ring, layout)` adapts it to `distlab.proof.models.Attention.core`: the block hands its heads'
(N, heads, seq/P, d_h) q, k, v to the ring instead of to torch's fused attention.
"""

from __future__ import annotations

import torch

from distlab.comm.ring import Ring
from distlab.layer_split.context_parallel import split as layouts
from distlab.layer_split.context_parallel.attention import Partial, Saved, causal_mask, fold_tile, tile_grads
from distlab.layer_split.context_parallel.split import DIAGONAL, SKIP, Layout


def _tiles(layout: Layout, rows_of: int, keys_of: int):
    """(rows, cols, mask-or-None) of every tile rank `rows_of`'s queries compute against rank `keys_of`'s
    block: skipped tiles left out, a diagonal one with its causal mask."""
    for rows, positions in layout.pieces(rows_of):
        for cols, key_positions in layout.pieces(keys_of):
            kind = layouts.tile_kind(positions, key_positions, layout.causal)
            if kind != SKIP:
                yield rows, positions, cols, key_positions, kind


def ring_forward(ring: Ring, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: Layout):
    """(out, lse) of this rank's queries against the whole sequence; k/v blocks travel the ring."""
    out, lse = torch.empty_like(q), q.new_empty(q.shape[:-1])
    parts = {rows.start: Partial.start(out[..., rows, :]) for rows, _ in layout.pieces(ring.rank)}
    kv = (k, v)
    for step in range(ring.world_size):
        source = (ring.rank - step) % ring.world_size  # whose k/v block this rank holds now
        arriving = ring.shift(*kv) if step < ring.world_size - 1 else None  # posted ahead of the math
        for rows, positions, cols, key_positions, kind in _tiles(layout, ring.rank, source):
            mask = causal_mask(positions, key_positions, q.device) if kind == DIAGONAL else None
            fold_tile(parts[rows.start], q[..., rows, :], kv[0][..., cols, :], kv[1][..., cols, :], mask)
        if arriving is not None:
            kv = tuple(arriving.wait())  # the block just used is dropped: two blocks at most
    for rows, _ in layout.pieces(ring.rank):
        parts[rows.start].finish(lse[..., rows])  # out = o / l, lse = m + log l
    return out, lse


def ring_backward(ring: Ring, saved: tuple, dout: torch.Tensor, layout: Layout):
    """(dq, dk, dv) of this rank's block: dq stays, (dk, dv) travel with their k/v block back home."""
    q, k, v, out, lse = saved
    delta = (dout * out).sum(-1)  # rowsum(dout * out) = rowsum(omega * (dout v^T)) over all keys
    dq, kv, dkv = torch.zeros_like(q), (k, v), (torch.zeros_like(k), torch.zeros_like(v))
    for step in range(ring.world_size):
        source = (ring.rank - step) % ring.world_size
        arriving = ring.shift(*kv) if step < ring.world_size - 1 else None
        for rows, positions, cols, key_positions, kind in _tiles(layout, ring.rank, source):
            mask = causal_mask(positions, key_positions, q.device) if kind == DIAGONAL else None
            here = Saved(q[..., rows, :], dout[..., rows, :], lse[..., rows], delta[..., rows])
            d_q, d_k, d_v = tile_grads(here, kv[0][..., cols, :], kv[1][..., cols, :], mask)
            dq[..., rows, :] += d_q
            dkv[0][..., cols, :] += d_k
            dkv[1][..., cols, :] += d_v
        dkv = tuple(ring.shift(*dkv).wait())  # the accumulators move on with their block
        if arriving is not None:
            kv = tuple(arriving.wait())
    return dq, dkv[0], dkv[1]  # after P moves, the accumulators of this rank's own block


class RingAttention(torch.autograd.Function):
    """attention(q, k, v) over the sequence laid out by `layout`, forward and backward by the ring."""

    @staticmethod
    def forward(ctx, q, k, v, ring: Ring, layout: Layout):
        out, lse = ring_forward(ring, q, k, v, layout)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.layout = ring, layout
        return out

    @staticmethod
    def backward(ctx, dout):
        dq, dk, dv = ring_backward(ctx.ring, ctx.saved_tensors, dout.contiguous(), ctx.layout)
        return dq, dk, dv, None, None


def ring_core(ring: Ring, layout: Layout):
    """An attention core for `distlab.proof.models.Attention.core`: (q, k, v, options) -> out by the ring. The
    layout says what is causal, so it must agree with the block's options (checked at every call)."""

    def core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options) -> torch.Tensor:
        if options.causal != layout.causal:
            raise ValueError(f"the block's causal={options.causal} disagrees with the ring's layout ({layout.causal})")
        return RingAttention.apply(q, k, v, ring, layout)

    return core
