"""The rank's own block of S, made once for its rows and its columns (the torch tiles' phases 2 and 3).

Rank r holds pairs `own` = [rC, rC + C). Phase 2 needs its rows of S (a_i: the strip S[own, :]) and its columns
(b_j: the strip S[:, own], walked as rows of S^T); phase 3 needs the two strips again, for G_x and G_y of each
micro-batch `glob` (its rows and its columns). Each pair of strips crosses in one square block, S[own, own] in
phase 2 and S[glob, glob] in phase 3, the block that holds every positive of those pairs; walked strip by strip,
the step makes that block twice. Made once, one tile feeds both sides, as the ring's pass 2 does:

    phase 2   `both_lse` on the block: each tile folds into its rows' (m, l) and its columns' (m, l);
              the strips' other columns hold no positive: plain row folds, then each LSE merged with the block's,
              lse = lse_block + log(1 + exp(lse_rest - lse_block)), and nll = nll_block + the same log term
              (the positive's precise nll from the block, never lse - S_ii, two numbers of size s, subtracted)
    phase 3   `ring_products` on the block: W = R + Q - 2 delta of each tile feeds W y into G_x's rows and
              W^T x into G_y's; the other columns: `pair_product` for each side, as before

Multiply-adds per rank at B = C, P ranks: phase 2 from 2 C N d to 2 C N d - C^2 d, phase 3 from 4 C N d to
4 C N d - C^2 d (with B < C, B^2 d less per micro-batch). At P = 2, N = 1,024, d = 256, T = 512: 10 tile
products of 512 x 512 x 256 where the strips made 12. The sums run in another order, so G and L differ from
the strips' in the last bits (tests/test_streamed.py holds them to the one-process reference as before).
"""

from __future__ import annotations

import torch

from distlab.streamed.kernel_choice import TileOps
from distlab.streamed.torch_tiles import Pairing


def others(block: slice, n: int) -> list[slice]:
    """The columns [0, n) outside `block`, as at most two slices (none empty)."""
    return [part for part in (slice(0, block.start), slice(block.stop, n)) if part.stop > part.start]


def merged(lse: torch.Tensor, nll: torch.Tensor, rest: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The block's (lse, nll) with the rest of the row folded in: log(1 + exp(rest - lse)) added to both."""
    if not rest:
        return lse, nll
    delta = torch.logsumexp(torch.stack(rest), dim=0) - lse
    grow = torch.logaddexp(torch.zeros_like(delta), delta)  # log(1 + e^delta), precise when it is tiny
    return lse + grow, nll + grow


def own_lse(z_x: torch.Tensor, z_y: torch.Tensor, s: float, own: slice, ops: TileOps) -> tuple[torch.Tensor, ...]:
    """(a_own, nll_x, b_own, nll_y): the rank's rows' and columns' LSEs of S = s Z_x Z_y^T and their nlls, the own
    block made once (`both_lse`), the other columns folded row by row (`row_lse`, an offset that puts the
    positives outside them)."""
    a, nll_x, b, nll_y = ops.both_lse(z_x[own], z_y[own], s)
    rest = others(own, len(z_x))
    rest_a = [ops.row_lse(z_x[own], z_y[cols], s, own.start - cols.start)[0] for cols in rest]
    rest_b = [ops.row_lse(z_y[own], z_x[cols], s, own.start - cols.start)[0] for cols in rest]
    return (*merged(a, nll_x, rest_a), *merged(b, nll_y, rest_b))


def block_pair_products(
    z_x: torch.Tensor, z_y: torch.Tensor, s: float, lse: tuple[torch.Tensor, torch.Tensor], coef, glob: slice, ops
) -> tuple[torch.Tensor, torch.Tensor]:
    """sum_j (R + Q - 2 delta)_ij z_j^y for rows `glob` and sum_i (R + Q - 2 delta)_ij z_i^x for columns `glob`
    (G_x, G_y up to s/(2N)); lse = (a, b) over all N; coef: R_ii + Q_ii - 2 of the rows. The block S[glob, glob]
    made once for both (`ring_products`), the other columns by `pair_product`."""
    a, b = lse
    x, y = z_x[glob], z_y[glob]
    g_x = torch.zeros_like(x)
    g_y = ops.ring_products(x, y, s, Pairing(a[glob], b[glob], coef, 0), g_x)  # W y into g_x, W^T x returned
    for cols in others(glob, len(z_x)):
        offset = glob.start - cols.start  # the positives' columns, glob.start + i, fall outside these
        g_x += ops.pair_product(x, z_y[cols], s, Pairing(a[glob], b[cols], coef, offset))
        g_y += ops.pair_product(y, z_x[cols], s, Pairing(b[glob], a[cols], coef, offset))
    return g_x, g_y
