"""Exercise 09: ring attention's forward (read lessons/09_context_parallel.py first; check your answer
with `pytest --exercises -k 09`; add `--hint-level 1`, 2 or 3 for help).

The sequence of seq positions is split over the P ranks by `layout` (contiguous, or zig-zag: rank r
holds pieces r and 2P-1-r of 2P). This rank (`ring.rank` of `ring.world_size`) holds its queries q and, to
begin with, its keys and values k, v (each h x seq/P x d_h). Write `ring_forward`: return (out, lse),
shaped like q and like q without its last dimension, where for every query row i of this rank

    out_i = sum_j softmax_j(A_ij) v_j,   lse_i = log sum_j exp A_ij,   A_ij = q_i . k_j / sqrt(d_h),

over every key j of the whole sequence (causal: j <= i only), while this rank never holds more than two k/v
blocks beyond its own: the blocks travel around the ring, and the softmax is folded block by block into
running statistics per query row, started at m = -inf, l = 0, o = 0:

    m' = max(m, rowmax A),   l' = l e^(m - m') + rowsum e^(A - m'),   o' = o e^(m - m') + e^(A - m') v,
    out = o / l,   lse = m + log l.

Causal attention (layout.causal): a tile of (query piece, key piece) whose keys all come after its queries
is skipped (it would only add -inf); a tile on the diagonal is computed with the keys after each query
masked. Count what you compute: for each tile you fold, `tally[kind] += 1` (kind "full" or "diagonal") and
`tally["products"] += rows x columns` of the tile.

What you are given: `ring.shift(k, v)` starts sending (k, v) to rank r + 1 and receiving the same shapes from
rank r - 1, and returns at once; its `.wait()` returns the received (k, v). Shift before you compute on the
block you hold, wait after: the transfer runs beside the math. `layout.pieces(rank)` gives a rank's pieces
as (slice into its block, range of global positions). The lesson's tile helpers live in
distlab.layer_split.context_parallel.

The judge (P = 4) checks out and lse against scaled_dot_product_attention on the whole sequence, the bytes
the ring sent (2 (P - 1) blocks), the products you counted against the layout's, and how many block-shaped
tensors you keep alive at once.
"""

from __future__ import annotations

from collections import Counter

import torch

from distlab.comm.ring import Ring
from distlab.layer_split.context_parallel.split import Layout


def ring_forward(
    ring: Ring, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: Layout, tally: Counter
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of this rank's queries against the whole sequence; k/v blocks travel the ring."""
    raise NotImplementedError("not written yet: ring_forward(ring, q, k, v, layout, tally)")
