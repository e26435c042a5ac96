"""Exercise 09: ring attention's forward (read lessons/09_context_parallel.py first; check your answer
with `pytest --exercises -k 09`).

The sequence of seq positions is split over the P ranks by `layout` (contiguous, or zig-zag: rank r
holds pieces r and 2P-1-r of 2P). This rank (`ring.rank` of `ring.world_size`) holds its queries q and,
to begin with, its keys and values k, v (each h x seq/P x d_h). Write `ring_forward`: in P steps, pass
the k/v block you hold to rank r+1 and receive the next one from r-1 (in step i you hold the block of
rank r-i), and fold every tile of scores A = q_piece k_piece^T / sqrt(d_h) into running statistics per
query row:

    m' = max(m, rowmax A),   l' = l e^(m - m') + rowsum e^(A - m'),   o' = o e^(m - m') + e^(A - m') v,

starting from m = -inf, l = 0, o = 0; at the end out = o / l and lse = m + log l. Return (out, lse),
shaped like q and like q without its last dimension.

Causal attention (layout.causal): a query at position i sees keys j <= i only. A tile whose keys all
come after its queries is skipped (it would only add -inf); a tile on the diagonal is computed with the
keys after the query masked. Count what you compute: for each tile you fold, `tally[kind] += 1`
(kind "full" or "diagonal") and `tally["products"] += rows x columns` of the tile.

Hints:
- `layout.pieces(rank)` gives a rank's pieces as (slice into its block, range of global positions);
  `distlab.context_parallel.split.tile_kind(query_positions, key_positions, causal)` says full,
  diagonal or skip, and `distlab.context_parallel.attention.causal_mask` builds the mask;
- `distlab.context_parallel.attention.Partial` and `fold_tile` hold and update (m, l, o) for one query
  piece: `fold_tile` is the fold above, built on `distlab.online_softmax.online_fold`;
- `ring.shift(k, v)` (a `distlab.comm.ring.Ring`) starts the exchange and returns at once; `.wait()`
  returns the received (k, v). Shift before you compute on the block you hold, wait after: the transfer
  runs beside the math. P - 1 moves.
"""

from __future__ import annotations

from collections import Counter

import torch

from distlab.comm.ring import Ring
from distlab.context_parallel.split import Layout


def ring_forward(
    ring: Ring, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: Layout, tally: Counter
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of this rank's queries against the whole sequence; k/v blocks travel the ring."""
    raise NotImplementedError(
        "not written yet: ring_forward(ring, q, k, v, layout, tally), the k/v "
        "blocks passed around the ring and every tile folded into (m, l, o)"
    )
