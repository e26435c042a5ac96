"""Phase 3's kernel (and the sigmoid loss's): sum_j W_ij k_j for a block of rows, W recomputed from S tile by
tile, never stored.

For each BLOCK_N block of columns a program makes its S tile in registers (`register_tile.s_tile`), turns it into the
tile of coefficients W, and adds W k[cols] into its rows of G (d in slices of BLOCK_D):

    InfoNCE (ROLE = INFONCE)   W_ij = exp(S_ij - lse_q_i) + exp(S_ij - lse_k_j) - 2 delta_ij = R + Q - 2 delta,
                               the diagonal's coefficient passed in precisely (expm1(-nll_x) + expm1(-nll_y));
                               G_x's rows with q = Z_x, k = Z_y, lse_q = a, lse_k = b; G_y's with roles swapped.
    sigmoid (ROLE = SIGMOID)   v = -eps S (S = s q k^T + beta), W = D = -(1/N) eps sigma(v), and each row's
                               sums of softplus(v) (its share of N L) and of D (of dL/dbeta), with
                               softplus(v) = max(v, 0) + log1p(exp(-|v|)): stable for any |S|.

Why G lives in memory. The accumulator G[rows] is BLOCK_M x d float32: at d = 1,024 and BLOCK_M = 128 that is
512 KiB, twice an SM's register file, so it cannot stay in registers as FlashAttention's output does for a head
of 64-256. The choices: (a) a grid over (row block, d slice) that keeps a BLOCK_M x BLOCK_D slice of G in
registers, which recomputes all of S once per d slice (d / BLOCK_D times the S work: 16x at d = 1,024); or
(b) keep W in registers and add W k[cols] into G in global memory one d slice at a time (Inf-CL's design).
This is (b): per BLOCK_N columns it reads and writes the program's BLOCK_M x d slice of G once (8 BLOCK_M d
bytes) against 2 BLOCK_M BLOCK_N d multiply-adds, 4 / BLOCK_N bytes per multiply-add (1/16 at the default
BLOCK_N = 64 for bf16; from L2 while a program's rows of G stay in it as it walks its columns, an assumption
the GPU run can test). Each program owns its rows of its own partial G (one per column range), so there are no
atomics and the result is deterministic.

Cost per launch, q of n_q rows, k of n_k: 2 n_q n_k d multiply-adds (S, then W k), two exps per element of S
(InfoNCE) or one exp and the series log1p (sigmoid).
"""

from __future__ import annotations

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
from distlab.streamed.kernels.register_tile import Operand, Tiling, dot, log1p, operand, s_tile
from distlab.streamed.torch_tiles import Pairing

INFONCE, SIGMOID = 0, 1  # ROLE


@triton.jit
def sigmoid_terms(s, hit, PRECISION: tl.constexpr):
    """(N D, softplus(v)) for a tile of logits S = s q k^T + beta: v = -eps S with eps = +1 where `hit`
    (the positives), N D = -eps sigma(v). sigma(v) and softplus(v) never overflow for any |S|.

    What each element costs on sm_90 (the PTX of the sigmoid GEMM's epilogue, bf16 128 x 128 x 64, Triton 3.9,
    `kernels_compile_check.py`): one ex2.approx, two div.full.f32 (Triton's float32 `/` is already the GPU's
    approximate division, 2 ulp: sigma's and the series' z) and ten fused multiply-adds, no register spilled.
    A log1p through `tl.log2` (a short series below 1/8, log2(1 + x) above) was tried and compiled worse:
    Triton lowers `tl.log2` to libdevice's accurate log2f (twelve more multiply-adds and the selects around it, not
    the MUFU lg2.approx), and the kernel then spilled 220 bytes a thread; the approximate lg2 needs inline PTX,
    which the interpreter cannot run, so nothing here could prove it."""
    v = tl.where(hit, -s, s)
    x = tl.exp(-tl.abs(v))
    softplus = tl.maximum(v, 0.0) + log1p(x, 17 if PRECISION == 3 else 8)
    sig = tl.where(v >= 0, 1.0, x) / (1.0 + x)
    return tl.where(hit, -sig, sig), softplus


@triton.jit
def infonce_vector(at, index, ok, T: Tiling):
    """One of the vectors the InfoNCE's coefficients read (lse_q, lse_k or the positives' coefficients) at
    `index`; zeros for the sigmoid, which reads none."""
    x = tl.zeros(index.shape, tl.float64 if T.PRECISION == 3 else tl.float32)
    if T.ROLE == 0:
        x = tl.load(at + index, mask=ok, other=0.0)
    return x


@triton.jit
def coefficients(s, hit, normalisers, sigmoid_logits, T: Tiling):
    """The tile of coefficients W from a tile of S (`hit`: where the positives are), and for the sigmoid each
    element's softplus(v) (its share of N L; the InfoNCE's second value is unused):

        InfoNCE  W = exp(S - lse_q) + exp(S - lse_k), the positives' R_ii + Q_ii - 2 passed in precisely
                 (normalisers = (lse_q per row, lse_k per column, the positives' coefficients per row));
        sigmoid  W = D = -(1/N) eps sigma(v) for S + beta (sigmoid_logits = (beta, 1/N))."""
    lse_q, lse_k, coef = normalisers
    if T.ROLE == 0:
        w = tl.exp(s - lse_q[:, None]) + tl.exp(s - lse_k[None, :])  # R + Q
        w = tl.where(hit, coef[:, None], w)  # R_ii + Q_ii - 2, passed in precisely
        softplus = w
    else:
        w, softplus = sigmoid_terms(s + sigmoid_logits[0], hit, T.PRECISION)
        w = w * sigmoid_logits[1]
    return w, softplus


@triton.jit
def product_kernel(q: Operand, k: Operand, out, vectors, walk, T: Tiling):
    """out = (G partials, loss row sums, D row sums); vectors = (lse_q, lse_k, diag_coef) (InfoNCE);
    walk = (d, columns per split, s, offset of the positives, beta, 1/N, scale of the product)."""
    g_at, loss_at, d_sum_at = out
    lse_q_at, lse_k_at, coef_at = vectors
    d, per_split, scale, offset, bias, inv_n, out_scale = walk
    block, split = tl.program_id(0), tl.program_id(1)
    rows = block * T.BLOCK_M + tl.arange(0, T.BLOCK_M)
    row_ok = rows < q.rows
    start = split * per_split
    end = tl.minimum(start + per_split, k.rows)
    acc = tl.float64 if T.PRECISION == 3 else tl.float32
    g_rows = g_at + (split.to(tl.int64) * q.rows + rows[:, None]) * d  # this range's partial G, my rows
    lse_q, coef = infonce_vector(lse_q_at, rows, row_ok, T), infonce_vector(coef_at, rows, row_ok, T)
    loss_sum = tl.zeros((T.BLOCK_M,), acc)
    d_sum = tl.zeros((T.BLOCK_M,), acc)
    for c0 in range(start, end, T.BLOCK_N):
        cols = c0 + tl.arange(0, T.BLOCK_N)
        col_ok = cols < end
        ok = row_ok[:, None] & col_ok[None, :]
        s = s_tile(q, k, rows, cols, d, scale, T)
        hit = cols[None, :] == rows[:, None] + offset
        lse_k = infonce_vector(lse_k_at, cols, col_ok, T)
        w, softplus = coefficients(s, hit, (lse_q, lse_k, coef), (bias, inv_n), T)
        if T.ROLE == 1:
            loss_sum += tl.sum(tl.where(ok, softplus, 0.0), 1)
            d_sum += tl.sum(tl.where(ok, w, 0.0), 1)
        w = operand(tl.where(ok, w, 0.0), T.PRECISION)
        for d0 in range(0, d, T.BLOCK_D):  # G[rows] += out_scale W k[cols], a BLOCK_M x BLOCK_D slice at a time
            dd = d0 + tl.arange(0, T.BLOCK_D)
            k_at = k.ptr + cols[:, None].to(tl.int64) * k.stride + dd[None, :]
            k_slice = tl.load(k_at, mask=col_ok[:, None] & (dd[None, :] < d), other=0.0)
            g_mask = row_ok[:, None] & (dd[None, :] < d)
            later = (tl.zeros((T.BLOCK_M, 1), tl.int32) + c0) > start  # the first column block starts G at 0
            g = tl.load(g_rows + dd[None, :], mask=g_mask & later, other=0.0)
            zero = tl.zeros((T.BLOCK_M, T.BLOCK_D), acc)
            g += dot(w, operand(k_slice, T.PRECISION), zero, T.PRECISION) * out_scale
            tl.store(g_rows + dd[None, :], g, mask=g_mask)
    if T.ROLE == 1:
        at = split.to(tl.int64) * q.rows + rows
        tl.store(loss_at + at, loss_sum, mask=row_ok)
        tl.store(d_sum_at + at, d_sum, mask=row_ok)


def _run(q, k, walk: tuple, vectors: tuple, role: int, precision: str, blocks: Blocks | None):
    """Launch the kernel over q's rows against all of k; (G, loss row sums, D row sums), summed over ranges."""
    n_q, d = q.shape
    interpreting = interpreted(product_kernel)
    code = precision_code(precision, q.dtype, interpreting)
    if blocks is None:  # on CUDA measured per card and d (`tuning`), elsewhere `launch.default_blocks`
        default = default_blocks(code, interpreting, sigmoid=role == SIGMOID)
        again = lambda b: _run(q, k, walk, vectors, role, precision, b)  # noqa: E731 - one candidate's run
        blocks = tuning.choose("sigmoid" if role == SIGMOID else "infonce", q, precision, default, again).blocks
    per_split, splits = column_split(n_q, len(k), blocks, q.device)
    g = torch.empty(splits, n_q, d, dtype=accumulator(code), device=q.device)
    loss, d_sum = torch.empty(2, splits, n_q if role == SIGMOID else 1, dtype=g.dtype, device=q.device)
    offset = len(k) if walk[1] is None else walk[1]  # no positive: an offset no column reaches
    args = (Operand(q, n_q, q.stride(0)), Operand(k, len(k), k.stride(0)), (g, loss, d_sum), vectors)
    args += ((d, per_split, float(walk[0]), offset, *walk[2:]), tiling(blocks, code, role))
    grid = (triton.cdiv(n_q, blocks.m), splits)
    launch(product_kernel, grid, args, blocks, nbytes(q, k, g, loss, d_sum, *vectors))
    return g.sum(0), loss.sum(0), d_sum.sum(0)


def pair_product(
    q: torch.Tensor,
    k: torch.Tensor,
    scale: float,
    pairing: Pairing,
    precision: str,
    out_scale: float = 1.0,
    blocks: Blocks | None = None,
) -> torch.Tensor:
    """out_scale sum_j (R_ij + Q_ij - 2 delta_ij) k_j for every row i of q, S = s q k^T: G_x's rows up to
    s/(2N) (q = Z_x rows, k = Z_y, lse_q = a, lse_k = b), or G_y's with the roles swapped. One launch and
    one sum over the column ranges; float32 (float64 for float64 embeddings)."""
    vectors = (pairing.lse_q, pairing.lse_k, pairing.diag_coef)
    walk = (scale, pairing.offset, 0.0, 0.0, float(out_scale))
    return _run(q, k, walk, vectors, INFONCE, precision, blocks)[0]


def sigmoid_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    logits: tuple[float, float],
    n: int,
    offset: int | None,
    precision: str,
    blocks: Blocks | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For S = s q k^T + beta (logits = (s, beta)) with row i's positive at column i + offset: (D k, the sum
    of softplus(-eps S) over the tile, the sum of D), D = -(1/N) eps sigma(-eps S) (`distlab.streamed.sigmoid`)."""
    dummy = q.new_empty(0)
    walk = (logits[0], offset, float(logits[1]), 1.0 / n, 1.0)
    g, loss, d_sum = _run(q, k, walk, (dummy, dummy, dummy), SIGMOID, precision, blocks)
    return g, loss.sum(), d_sum.sum()
