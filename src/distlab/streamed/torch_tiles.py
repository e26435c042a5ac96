"""The streamed step's tile math on one process: log-sum-exps by the online fold, G in T x T tiles.

Notation (the README's table): S = s Z_x Z_y^T with the logit scale s; a_i, b_j the row and column
log-sum-exps of S; R_ij = exp(S_ij - a_i) the row softmax, Q_ij = exp(S_ij - b_j) the column
softmax; T the stream chunk (`STREAM_CHUNK_SIZE`), so every tile is at most T x T (rows in blocks of
T, columns in chunks of T, whatever the micro-batch B is).

Nothing here communicates: these functions take gathered (or, in the ring, visiting) embeddings and are
tested against autograd in one process. `distlab.streamed.kernel_choice` hands them to the step's phases 2 and 3
and to the ring's passes (`TorchTiles`), or the Triton kernels that do the same work (`TritonTiles`).

The streaming log-sum-exp is the online max/sum fold of `distlab.pieces.online_softmax` (every exponent <= 0,
so nothing overflows however large S gets, and no row is ever whole).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from distlab.pieces.chunks import chunks
from distlab.pieces.online_softmax import online_fold


def diagonal_crossing(start_q: int, start_k: int, rows: int, cols: int) -> tuple[slice, slice] | None:
    """Where the global diagonal (i, i) crosses a tile of rows [start_q, +rows), cols [start_k, +cols)."""
    lo, hi = max(start_q, start_k), min(start_q + rows, start_k + cols)
    return (slice(lo - start_q, hi - start_q), slice(lo - start_k, hi - start_k)) if lo < hi else None


def lse_and_nll(run_max, run_sum, diag) -> tuple[torch.Tensor, torch.Tensor]:
    """(lse, nll) with nll = lse - diag = -log softmax at the positive. The diagonal is read from the
    very tile whose max it is compared with, so when the positive is the row's max, max - diag is
    exactly 0 and nll = log(l) keeps full precision even when it is tiny (a confident model);
    lse - diag would cancel two numbers of size s."""
    log_sum = run_sum.log()
    return run_max + log_sum, (run_max - diag) + log_sum


def streamed_lse(
    q: torch.Tensor, k: torch.Tensor, scale: float, t: int, offset: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Row LSE of s q k^T and its nll, in tiles of at most T x T. Row i of q is global pair
    offset + i, so its positive is k[offset + i]. With q = Z_x[mine], k = Z_y: a[mine]; with
    q = Z_y[mine], k = Z_x: b[mine] (my columns of S are my rows of S^T)."""
    lse, nll = torch.empty(2, len(q), dtype=q.dtype, device=q.device)
    for rows in chunks(len(q), t):
        q_rows = q[rows] * scale
        run_max = torch.full((len(q_rows),), float("-inf"), dtype=q.dtype, device=q.device)
        run_sum, diag = torch.zeros_like(run_max), torch.empty_like(run_max)
        for cols in chunks(len(k), t):
            tile = q_rows @ k[cols].T
            if hit := diagonal_crossing(offset + rows.start, cols.start, len(q_rows), cols.stop - cols.start):
                diag[hit[0]] = tile[hit].diagonal()
            run_max, run_sum = online_fold(run_max, run_sum, tile, dim=1)
        lse[rows], nll[rows] = lse_and_nll(run_max, run_sum, diag)
    return lse, nll


def streamed_lse_both(z_x: torch.Tensor, z_y: torch.Tensor, scale: float, t: int) -> tuple[torch.Tensor, ...]:
    """(a, nll_x, b, nll_y): the row and the column LSE of S = s Z_x Z_y^T (with their nlls) from one
    pass over T x T tiles: each tile feeds its rows' and its columns' running (m, l)."""
    n, kw = len(z_x), dict(dtype=z_x.dtype, device=z_x.device)
    col_max, col_sum, col_diag = torch.full((n,), float("-inf"), **kw), torch.zeros(n, **kw), torch.empty(n, **kw)
    a, nll_x = torch.empty(2, n, **kw)
    for rows in chunks(n, t):
        x_rows = z_x[rows] * scale
        run_max = torch.full((len(x_rows),), float("-inf"), **kw)
        run_sum, diag = torch.zeros_like(run_max), torch.empty_like(run_max)
        for cols in chunks(n, t):
            tile = x_rows @ z_y[cols].T
            if hit := diagonal_crossing(rows.start, cols.start, len(x_rows), cols.stop - cols.start):
                diag[hit[0]] = col_diag[cols][hit[1]] = tile[hit].diagonal()
            col_max[cols], col_sum[cols] = online_fold(col_max[cols], col_sum[cols], tile.clone(), dim=0)
            run_max, run_sum = online_fold(run_max, run_sum, tile, dim=1)
        a[rows], nll_x[rows] = lse_and_nll(run_max, run_sum, diag)
    b, nll_y = lse_and_nll(col_max, col_sum, col_diag)
    return a, nll_x, b, nll_y


def streamed_softmax_pair_product(
    q_scaled: torch.Tensor,
    k: torch.Tensor,
    lse_q: torch.Tensor,
    lse_k: torch.Tensor,
    diag_coef: torch.Tensor,
    offset: int,
    t: int,
) -> torch.Tensor:
    """sum_j (exp(S_ij - lse_q_i) + exp(S_ij - lse_k_j) - 2 delta_{j, offset + i}) k_j, with
    S_ij = q_scaled_i . k_j (q_scaled = s q); diag_coef_i is the diagonal's coefficient, passed in
    precisely (see `_pair_product_rows`).

    With q = Z_x[rows], k = Z_y, lse_q = a[rows], lse_k = b this is sum_j (R_ij + Q_ij - 2 delta_ij) z_j^y
    for those rows (G_x up to s/(2N)); with q = Z_y[rows], k = Z_x, lse_q = b[rows], lse_k = a it is
    sum_i (R_ij + Q_ij - 2 delta_ij) z_i^x (G_y up to s/(2N)). Streamed in tiles of at most T x T
    (rows of q in blocks of T, k in chunks of T): two tiles are alive at a time, never a B x N slice,
    and whatever B is the tiles stay cache-sized. Each row's sum runs over the same chunks of k in the
    same order, so blocking the rows changes nothing but the rounding of the mm.
    """
    acc = torch.empty_like(q_scaled)
    for rows in chunks(len(q_scaled), t):
        acc[rows] = _pair_product_rows(q_scaled[rows], k, lse_q[rows], lse_k, diag_coef[rows], offset + rows.start, t)
    return acc


def _pair_product_rows(q_scaled, k, lse_q, lse_k, diag_coef, offset, t) -> torch.Tensor:
    """One block of at most T rows of `streamed_softmax_pair_product`: |q| x T tiles over k."""
    acc = torch.zeros_like(q_scaled)
    for cols in chunks(len(k), t):
        tile = q_scaled @ k[cols].T  # S, |q| x T
        hit = diagonal_crossing(offset, cols.start, len(q_scaled), cols.stop - cols.start)
        acc.addmm_(pair_coefficients(tile, lse_q, lse_k[cols], hit, diag_coef), k[cols])
    return acc


def pair_coefficients(
    tile: torch.Tensor,
    lse_q: torch.Tensor,
    lse_k: torch.Tensor,
    hit: tuple[slice, slice] | None,
    diag_coef: torch.Tensor,
) -> torch.Tensor:
    """R + Q - 2 delta (= 2N dL/dS) for one tile of S, in place: exp(S - lse_q) + exp(S - lse_k), and
    where the tile crosses the diagonal (`hit`), diag_coef for its rows, passed in precisely:
    R_ii + Q_ii - 2 = expm1(-nll_x) + expm1(-nll_y), no cancellation of two numbers near 2."""
    other = torch.sub(tile, lse_k).exp_()  # exp(S - lse_k): Q (or R^T)
    tile.sub_(lse_q[:, None]).exp_().add_(other)  # + exp(S - lse_q): R (or Q^T), in place
    if hit:
        tile[hit].diagonal().copy_(diag_coef[hit[0]])
    return tile


@dataclass(frozen=True)
class Pairing:
    """What R + Q - 2 delta needs besides S: the rows' and the columns' log-sum-exps, the positives'
    coefficients R_ii + Q_ii - 2 (one per row), and where the positives are: row i's at column i + offset
    (None: the columns hold none of the rows' positives)."""

    lse_q: torch.Tensor
    lse_k: torch.Tensor
    diag_coef: torch.Tensor
    offset: int | None


@dataclass
class RowFold:
    """The ring's pass 1 on one rank: its rows' running (m, l) and its pairs' logits S_ii (read once, from
    the tile of its own block that holds them, for its rows and for its columns)."""

    m: torch.Tensor
    l: torch.Tensor  # noqa: E741 - the fold's l, as in `distlab.pieces.online_softmax`
    diag_rows: torch.Tensor
    diag_cols: torch.Tensor


def ring_fold_tiles(xs: torch.Tensor, y_j: torch.Tensor, rows_fold: RowFold, own: bool, t: int) -> list:
    """The ring's pass 1 against one visiting block y_j, tile by tile (xs = s x): each tile folds into the
    rank's rows (in place) and into the block's fresh column (m, l), which is returned."""
    kw = dict(dtype=xs.dtype, device=xs.device)
    col_m, col_l = torch.full((len(y_j),), float("-inf"), **kw), torch.zeros(len(y_j), **kw)
    for rows in chunks(len(xs), t):
        for cols in chunks(len(y_j), t):
            tile = xs[rows] @ y_j[cols].T
            hit = diagonal_crossing(rows.start, cols.start, len(tile), tile.shape[1])
            if own and hit:
                rows_fold.diag_rows[rows][hit[0]] = rows_fold.diag_cols[cols][hit[1]] = tile[hit].diagonal()
            col_m[cols], col_l[cols] = online_fold(col_m[cols], col_l[cols], tile.clone(), dim=0)
            rows_fold.m[rows], rows_fold.l[rows] = online_fold(rows_fold.m[rows], rows_fold.l[rows], tile, dim=1)
    return [col_m, col_l]


def ring_product_tiles(x: torch.Tensor, y_j: torch.Tensor, scale: float, pairing: Pairing, into_rows, t: int):
    """The ring's pass 2 against one visiting block: each tile of S and its coefficients R + Q - 2 delta feed
    both products, (R + Q - 2 delta) y_j added into `into_rows` and (R + Q - 2 delta)^T x returned (3 C^2 d)."""
    part, xs = torch.zeros_like(y_j), x * scale
    for rows in chunks(len(x), t):
        for cols in chunks(len(y_j), t):
            tile = xs[rows] @ y_j[cols].T
            hit = diagonal_crossing(rows.start, cols.start, len(tile), tile.shape[1])
            own = hit if pairing.offset is not None else None
            tile = pair_coefficients(tile, pairing.lse_q[rows], pairing.lse_k[cols], own, pairing.diag_coef[rows])
            into_rows[rows].addmm_(tile, y_j[cols])
            part[cols].addmm_(tile.T, x[rows])
    return part
