"""Phase 2's kernel: the row log-sum-exps of S = s q k^T, the positive's logit, and (for the ring) the column
partials of the same tiles, in one launch.

A program owns BLOCK_M rows and walks its range of columns (`launch.column_split`) a BLOCK_N block at a time:
each S tile is made in registers (`register_tile.s_tile`, d in slices of BLOCK_D) and folded into the rows' running max
m and sum l = sum_j exp(S_ij - m) (the online fold of `distlab.pieces.online_softmax`), then dropped. Where the tile
holds row i's positive (column i + offset) its logit S_ii is stored from that very tile, so that
nll_i = (m_i - S_ii) + log l_i is exactly log l_i when the positive is the row's max (`torch_tiles.lse_and_nll`).
With ROLE = COLUMNS the tile is also folded down its columns (max, then the sum of exp under it): one (m, l)
per (row block, column), which the ring's pass 1 merges into the visiting block's column normalisers, so one
S tile serves both folds. Each column range writes its own (m, l) partial; `row_lse` merges them in order.
With ROLE + FROM_MEMORY the same program reads its S tiles from a chunk of S that cuBLAS made (`s_in_memory`,
KERNELS "triton-s"): the fold is then a memory-bound pass, 4 bytes of S read per element and no dot.

Cost per launch, q of n_q rows, k of n_k, width d: n_q n_k d multiply-adds, one exp per element of S (two
with COLUMNS); it reads q once per column block and k once per row block (from L2 when they fit) and writes
2 n_q splits numbers (plus 2 n_k n_q / BLOCK_M with COLUMNS).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from distlab.streamed.kernels import tuning
from distlab.streamed.kernels.launch import (
    Blocks,
    accumulator,
    column_split,
    default_blocks,
    interpreted,
    launch,
    nbytes,
    precision_code,
    tiling,
)
from distlab.streamed.kernels.register_tile import BF16, Operand, Tiling, s_tile

ROWS, COLUMNS = 0, 1  # ROLE: the rows' fold only, or the columns' too
FROM_MEMORY = 2  # added to ROLE: the S tiles read from a chunk of S in memory (`s_in_memory`), not made here


@triton.jit
def lse_tile(q: Operand, k: Operand, rows, cols, d, scale, T: Tiling):
    """The S tile a fold program walks: made in registers from q and k (`s_tile`), or with ROLE >= FROM_MEMORY
    read from a chunk of raw dot products q k^T in memory (q's pointer then holds that chunk, q.rows x k.rows
    with row stride q.stride; k names only its columns) and scaled here, as `s_tile` scales its sums."""
    if T.ROLE >= 2:
        ok = (rows[:, None] < q.rows) & (cols[None, :] < k.rows)
        raw = tl.load(q.ptr + rows[:, None].to(tl.int64) * q.stride + cols[None, :], mask=ok, other=0.0)
        s = raw * scale
    else:
        s = s_tile(q, k, rows, cols, d, scale, T)
    return s


@triton.jit
def lse_kernel(q: Operand, k: Operand, out, walk, T: Tiling):
    """out = (m, l, diag, col_m, col_l) pointers; walk = (d, columns per split, s, offset of the positives)."""
    m_at, l_at, diag_at, col_m_at, col_l_at = out
    d, per_split, scale, offset = walk
    block, split = tl.program_id(0), tl.program_id(1)
    rows = block * T.BLOCK_M + tl.arange(0, T.BLOCK_M)
    row_ok = rows < q.rows
    start = split * per_split
    end = tl.minimum(start + per_split, k.rows)
    acc = tl.float64 if T.PRECISION == 3 else tl.float32
    run_max = tl.full((T.BLOCK_M,), float("-inf"), acc)
    run_sum = tl.zeros((T.BLOCK_M,), acc)
    for c0 in range(start, end, T.BLOCK_N):
        cols = c0 + tl.arange(0, T.BLOCK_N)
        col_ok = cols < end
        s = tl.where(col_ok[None, :], lse_tile(q, k, rows, cols, d, scale, T), float("-inf"))
        hit = (cols[None, :] == rows[:, None] + offset) & col_ok[None, :]
        found = tl.sum(hit.to(tl.int32), 1) > 0
        tl.store(diag_at + rows, tl.sum(tl.where(hit, s, 0.0), 1), mask=found & row_ok)
        new_max = tl.maximum(run_max, tl.max(s, 1))
        run_sum = run_sum * tl.exp(run_max - new_max) + tl.sum(tl.exp(s - new_max[:, None]), 1)
        run_max = new_max
        if T.ROLE % 2 == 1:  # the same tile folded down its columns, over this block's valid rows
            s_col = tl.where(row_ok[:, None], s, float("-inf"))
            col_max = tl.max(s_col, 0)
            safe = tl.where(col_ok, col_max, 0.0)  # a column past the end is all -inf: keep exp() finite
            col_sum = tl.sum(tl.exp(s_col - safe[None, :]), 0)
            at = block.to(tl.int64) * k.rows + cols
            tl.store(col_m_at + at, col_max, mask=col_ok)
            tl.store(col_l_at + at, col_sum, mask=col_ok)
    at = split.to(tl.int64) * q.rows + rows
    tl.store(m_at + at, run_max, mask=row_ok)
    tl.store(l_at + at, run_sum, mask=row_ok)


@dataclass
class Folded:
    """The online fold's (m, l) of every row of s q k^T (lse = m + log l), the positives' logits (rows whose
    positive lies in k; other entries undefined), and with `columns` the (m, l) of every column over q's rows."""

    m: torch.Tensor
    l: torch.Tensor  # noqa: E741 - the fold's l, as in `distlab.pieces.online_softmax`
    diag: torch.Tensor
    col_m: torch.Tensor | None = None
    col_l: torch.Tensor | None = None


def merge(m: torch.Tensor, l: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: E741
    """Partials (m, l) stacked along dim 0, folded into one: the max of the m's, the l's rescaled to it."""
    top = m.amax(0)
    return top, (l * torch.exp(m - top)).sum(0)


def fold_blocks(code: int, interpreting: bool, columns: bool) -> Blocks:
    """The fold's tile: `launch.default_blocks`, except the ring's fold in bf16 (`columns`: column statistics
    too), which in 128 x 256 tiles spills 1,256 bytes a thread and took 0.0013 s a visit on an H200, in
    128 x 128 x 64 0.0010 s (one rank of N = 65,536, P = 8, d = 1,024;
    benchmarks/results/gpu/2026-11-28-decide-h200)."""
    if columns and code == BF16 and not interpreting:
        return Blocks(128, 128, 64, 8, 3)
    return default_blocks(code, interpreting)


def row_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    scale: float,
    offset: int | None,
    precision: str,
    columns: bool = False,
    blocks: Blocks | None = None,
) -> Folded:
    """The fold of every row of S = s q k^T in one launch (plus a few small ops merging the column ranges).
    Row i's positive is column i + offset (None: k holds no positive). float32 statistics (float64 for
    float64 embeddings); q and k in one dtype, unit stride along d."""
    n_q, d = q.shape
    code = precision_code(precision, q.dtype, interpreted(lse_kernel))
    if blocks is None:  # on CUDA measured per card and d (`tuning`), elsewhere `fold_blocks`
        default = fold_blocks(code, interpreted(lse_kernel), columns)
        again = lambda b: row_lse(q, k, scale, offset, precision, columns, b)  # noqa: E731 - one candidate's run
        blocks = tuning.choose("ring-fold" if columns else "fold", q, precision, default, again).blocks
    operands = Operand(q, n_q, q.stride(0)), Operand(k, len(k), k.stride(0))
    return launch_fold(*operands, (d, scale, offset), (code, columns, blocks, False), nbytes(q, k))


def launch_fold(q: Operand, k: Operand, walk: tuple, how: tuple, moved: int) -> Folded:
    """One launch of `lse_kernel` over q's rows against k's and the merge of its column ranges; walk = (d, s,
    offset of the positives or None), how = (precision code, column statistics too, blocks, from memory). From
    memory (`s_in_memory`): q's pointer is a chunk of raw dot products q k^T, k names only its columns."""
    (d, scale, offset), (code, columns, blocks, from_memory) = walk, how
    memory = FROM_MEMORY if from_memory else 0
    n_q, n_k, device = q.rows, k.rows, q.ptr.device
    per_split, splits = column_split(n_q, n_k, blocks, device)
    row_blocks = triton.cdiv(n_q, blocks.m)
    kw = dict(dtype=accumulator(code), device=device)
    m, l = torch.empty(2, splits, n_q, **kw)  # noqa: E741
    diag = torch.empty(n_q, **kw)
    col_m, col_l = torch.empty(2, row_blocks if columns else 1, n_k if columns else 1, **kw)
    walk = (d, per_split, float(scale), n_k if offset is None else offset)  # no positive: no column reaches it
    args = (q, k, (m, l, diag, col_m, col_l), walk, tiling(blocks, code, (COLUMNS if columns else ROWS) + memory))
    launch(lse_kernel, (row_blocks, splits), args, blocks, moved + nbytes(m, l, diag, col_m, col_l))
    folded = Folded(*merge(m, l), diag)
    if columns:
        folded.col_m, folded.col_l = merge(col_m, col_l)
    return folded
