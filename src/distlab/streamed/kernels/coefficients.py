"""Phase 3 (and the sigmoid loss) with the coefficient tile W in memory: a Triton GEMM whose epilogue turns each
S tile into W, then torch's matmul (cuBLAS on GPUs) for W k. KERNELS "triton-mm".

`product` keeps W in registers and adds W k into G in global memory a d-slice at a time: at d = 1,024 each
column block reads and writes the program's BLOCK_M x d slice of G, which on an H100 made the product the
step's bottleneck (one rank of N = 65,536, P = 8: 0.035 s against the 6 C N d matmul floor's 0.0095 s,
benchmarks/results/gpu/2026-11-26-kernels-h100). Here each product is two launches per chunk of rows:

    1. `coefficient_kernel`: one program per BLOCK_M x BLOCK_N tile of S (`register_tile.s_tile`, d in slices of
       BLOCK_D: a GEMM), whose epilogue makes W (`product.coefficients`: R + Q - 2 delta, or the sigmoid's
       D) and stores it, in bf16 under MATMUL_PRECISION "bf16" (the rounding `product` gives W before its
       second dot), else float32 (float64 for float64 embeddings); for the sigmoid also each row's partial
       sums of softplus(v) and of D, one per column block, summed in order afterwards (no atomics);
    2. G[rows] = W k: one matmul over all of k's rows, written straight into G's rows (`out=`; cuBLAS
       accumulates bf16 x bf16 in float32), so each row's sum is made in one place, as in `product`; where
       the visiting columns' product is wanted too, W^T q[rows] is added into it in place (`addmm_`), not
       as `g_cols += product`, which would make a n_k x d float32 temporary and read G's columns twice more
       per chunk (about 34 GB at P = 1, N = 65,536 in 2,048-row chunks). out_scale multiplies once, at the end.

S is made once per product, as in `product`; what changes is where the d-long accumulation of W k happens
(cuBLAS's registers, along N, instead of global memory, along d). Where both products of one block are
wanted (a ring's visit: W k for the rows, W^T q for the visiting columns) both read the same W
(`pair_products`, `sigmoid_rows_and_columns`): one S for two products, as the torch tiles have it.

The price is memory: a chunk of W, w_rows x n_k, at most the budget's bytes: W_BUDGET on a GPU (512 MiB: 4,096
rows of bf16 W at N = 65,536, as fast as 8,192 rows and 9% faster than 2,048 on an H200,
benchmarks/results/gpu/2026-11-28-decide-h200/decide; one rank's step at P = 8 then stays inside 1/8 of
ClipLoss's 8.3 GiB), the config's W_MEMORY_MIB where it is set (`Job.w_bytes`), CPU_BUDGET on a CPU; and
launches: two or three per chunk, so their number grows with n_q n_k / budget (not with N / T as the torch
tiles' do). On CUDA the tile, warps, stages and rows of W come from `tuning` (measured per card and d).

Cost per launch pair, q of n_q rows, k of n_k: 2 n_q n_k d multiply-adds (S, then W k), two exps per element
of S (InfoNCE) or one exp and the series log1p (sigmoid); W written once and read once (2 or 4 bytes per
element of S).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from distlab.streamed.chunk_size import CPU_BUDGET
from distlab.streamed.kernels import tuning
from distlab.streamed.kernels.launch import (
    Blocks,
    accumulator,
    default_blocks,
    interpreted,
    launch,
    nbytes,
    precision_code,
    tiling,
)
from distlab.streamed.kernels.product import INFONCE, SIGMOID, coefficients, infonce_vector
from distlab.streamed.kernels.register_tile import BF16, BF16_WIDENED, Operand, Tiling, s_tile
from distlab.streamed.torch_tiles import Pairing

W_BUDGET = 512 * 2**20  # bytes of W alive at once on a GPU (the module docstring)


@triton.jit
def coefficient_kernel(q: Operand, k: Operand, out, vectors, walk, T: Tiling):
    """out = (W, loss partials, D partials): W q.rows x k.rows, the partials q.rows x column blocks, both
    row-major; vectors = (lse_q, lse_k, diag_coef) (InfoNCE); walk = (d, s, offset of the positives, beta,
    1/N)."""
    w_at, loss_at, d_sum_at = out
    d, scale, offset, bias, inv_n = walk
    block, col_block = tl.program_id(0), tl.program_id(1)
    rows = block * T.BLOCK_M + tl.arange(0, T.BLOCK_M)
    cols = col_block * T.BLOCK_N + tl.arange(0, T.BLOCK_N)
    row_ok, col_ok = rows < q.rows, cols < k.rows
    ok = row_ok[:, None] & col_ok[None, :]
    s = s_tile(q, k, rows, cols, d, scale, T)
    hit = cols[None, :] == rows[:, None] + offset
    lse_q, coef = infonce_vector(vectors[0], rows, row_ok, T), infonce_vector(vectors[2], rows, row_ok, T)
    w, softplus = coefficients(s, hit, (lse_q, infonce_vector(vectors[1], cols, col_ok, T), coef), (bias, inv_n), T)
    w = tl.where(ok, w, 0.0)
    if T.ROLE == 1:  # this tile's share of each row's sums: one partial per (row, column block)
        at = rows.to(tl.int64) * tl.num_programs(1) + col_block
        tl.store(loss_at + at, tl.sum(tl.where(ok, softplus, 0.0), 1), mask=row_ok)
        tl.store(d_sum_at + at, tl.sum(w, 1), mask=row_ok)
    # W in the dtype of its buffer: bf16 under MATMUL_PRECISION "bf16" (rounded here, as `product` rounds W)
    tl.store(w_at + rows[:, None].to(tl.int64) * k.rows + cols[None, :], w.to(w_at.dtype.element_ty), mask=ok)


def default_gemm_blocks(code: int, interpreting: bool, role: int) -> Blocks:
    """A GEMM's tile for the coefficient kernel in bf16, by measurement on an H200 (one rank of N = 65,536,
    P = 8, d = 1,024; benchmarks/results/gpu/2026-11-28-decide-h200, `kernels_gpu.py --sweep`): the InfoNCE
    128 x 256 x 64, 8 warps, 3 stages (0.0160 s a step against 0.0173 s in 128 x 128 x 64); the sigmoid,
    whose epilogue needs more registers, 128 x 128 x 64 (the usual Hopper GEMM tile; 0.0105 s). Elsewhere
    `launch.default_blocks`."""
    if code == BF16 and not interpreting:
        return Blocks(128, 128, 64, 8, 3) if role == SIGMOID else Blocks(128, 256, 64, 8, 3)
    return default_blocks(code, interpreting)


def chunk_rows(n_q: int, n_k: int, itemsize: int, blocks: Blocks, device: torch.device, budget: int | None) -> int:
    """Rows of W per chunk: as many whole row blocks as the budget holds (`budget` bytes, else W_BUDGET, and
    CPU_BUDGET on a CPU; the meta device counts a GPU's step), at least one block, at most n_q; `blocks.w_rows`
    where it is set and fits in that budget."""
    budget = budget or (CPU_BUDGET if device.type == "cpu" else W_BUDGET)
    rows = max(budget // max(1, n_k * itemsize) // blocks.m * blocks.m, blocks.m)
    return max(1, min(rows, blocks.w_rows or rows, n_q))


def mm_into(out: torch.Tensor, w: torch.Tensor, k: torch.Tensor, add: bool) -> torch.Tensor:
    """out = w @ k (add: out += w @ k) in out's dtype (float32, or float64), written in place: on CUDA a 16-bit
    w and k go to cuBLAS as they are, accumulating in float32 (`out_dtype`); elsewhere they are widened exactly
    first, which is the same arithmetic (a bf16 product is exact in float32) summed in another order."""
    if w.device.type in ("cuda", "meta") and w.dtype in (torch.bfloat16, torch.float16) and w.dtype == k.dtype:
        if not add:
            return torch.mm(w, k, out_dtype=out.dtype, out=out)
        if mixed_addmm(w.device):
            return torch.addmm(out, w, k, out_dtype=out.dtype, out=out)
        return out.add_(torch.mm(w, k, out_dtype=out.dtype))  # older torch: a float32 self with bf16 factors refused
    return out.addmm_(w.to(out.dtype), k.to(out.dtype), beta=1 if add else 0)


_MIXED: dict[str, bool] = {}


def mixed_addmm(device: torch.device) -> bool:
    """Whether this torch adds a 16-bit product into a float32 matrix in place on `device` (addmm with
    out_dtype and a float32 self: newer torch accepts it, older asks self to be 16-bit too). Asked once."""
    if device.type not in _MIXED:
        a = torch.zeros(2, 2, dtype=torch.bfloat16, device=device)
        try:
            torch.addmm(torch.zeros(2, 2, device=device), a, a, out_dtype=torch.float32)
            _MIXED[device.type] = True
        except RuntimeError:
            _MIXED[device.type] = False
    return _MIXED[device.type]


class Job(NamedTuple):
    """What one call computes. role: INFONCE or SIGMOID; walk = (s, offset of the positives or None, beta, 1/N,
    scale of the products); vectors = the InfoNCE's (lse_q, lse_k, diag_coef); columns: W^T q as well, from the
    same W (each chunk's share added in order); w_bytes: the most bytes of W alive at once."""

    role: int
    walk: tuple
    vectors: tuple
    columns: bool = False
    w_bytes: int | None = None  # the budget of W in bytes (config W_MEMORY_MIB); None: `chunk_rows`'s default


def gemm_blocks(q: torch.Tensor, k: torch.Tensor, job: Job, precision: str) -> Blocks:
    """The launch configuration: on CUDA measured (`tuning`: the table, the cache, or a search on these very
    operands), elsewhere `default_gemm_blocks`."""
    interpreting = interpreted(coefficient_kernel)
    default = default_gemm_blocks(precision_code(precision, q.dtype, interpreting), interpreting, job.role)
    kind = "sigmoid-mm" if job.role == SIGMOID else "infonce-mm"
    return tuning.choose(kind, q, precision, default, lambda blocks: run(q, k, job, precision, blocks)).blocks


def run(q, k, job: Job, precision: str, blocks: Blocks | None):
    """W made chunk by chunk of q's rows, each multiplied into its rows of G at once (and, with job.columns,
    added into all of W^T q): (G for q's rows, W^T q or None, loss row sums, D row sums)."""
    (n_q, d), (role, walk, vectors, columns, w_bytes) = q.shape, job
    code = precision_code(precision, q.dtype, interpreted(coefficient_kernel))
    blocks = blocks or gemm_blocks(q, k, job, precision)
    acc = accumulator(code)
    w_dtype = torch.bfloat16 if code in (BF16, BF16_WIDENED) else acc
    rows_per = chunk_rows(n_q, len(k), torch.finfo(w_dtype).bits // 8, blocks, q.device, w_bytes)
    col_blocks = math.ceil(len(k) / blocks.n)
    g = torch.empty(n_q, d, dtype=acc, device=q.device)
    g_cols = torch.zeros(len(k), d, dtype=acc, device=q.device) if columns else None
    loss, d_sum = torch.empty(2, n_q if role == SIGMOID else 1, col_blocks, dtype=acc, device=q.device)
    scale, offset, *logits, out_scale = walk
    offset = len(k) if offset is None else offset  # no positive: an offset no column reaches
    for r0 in range(0, n_q, rows_per):
        rows = slice(r0, min(r0 + rows_per, n_q))
        n_rows = rows.stop - r0
        w = torch.empty(n_rows, len(k), dtype=w_dtype, device=q.device)
        chunk_vectors = (vectors[0][rows], vectors[1], vectors[2][rows]) if role == INFONCE else vectors
        parts = (loss[rows], d_sum[rows]) if role == SIGMOID else (loss, d_sum)
        args = (Operand(q[rows], n_rows, q.stride(0)), Operand(k, len(k), k.stride(0)), (w, *parts), chunk_vectors)
        args += ((d, float(scale), offset + r0, *logits), tiling(blocks, code, role))
        grid = (triton.cdiv(n_rows, blocks.m), col_blocks)
        launch(coefficient_kernel, grid, args, blocks, nbytes(q[rows], k, w, *parts, *chunk_vectors))
        mm_into(g[rows], w, k, add=False)  # rows of a row-major G: a contiguous view, written in place
        if columns:
            mm_into(g_cols, w.T, q[rows], add=True)
    g_cols = None if g_cols is None else g_cols.mul_(out_scale)
    return g.mul_(out_scale), g_cols, loss.sum(1), d_sum.sum(1)


def pair_products(
    q: torch.Tensor,
    k: torch.Tensor,
    scale: float,
    pairing: Pairing,
    precision: str,
    out_scale: float = 1.0,
    blocks: Blocks | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """out_scale sum_j (R_ij + Q_ij - 2 delta_ij) k_j for every row i of q (`pair_product`) and out_scale
    sum_i (R_ij + Q_ij - 2 delta_ij) q_i for every row j of k, from the same W: the ring's two products of one
    visit in 3 n_q n_k d multiply-adds (S once, then each product), where the fused kernels make S twice."""
    return run(q, k, infonce_job(scale, pairing, out_scale, True), precision, blocks)[:2]


def pair_product(
    q: torch.Tensor,
    k: torch.Tensor,
    scale: float,
    pairing: Pairing,
    precision: str,
    out_scale: float = 1.0,
    blocks: Blocks | None = None,
) -> torch.Tensor:
    """`product.pair_product`, W in memory: out_scale sum_j (R_ij + Q_ij - 2 delta_ij) k_j for every row of q."""
    return run(q, k, infonce_job(scale, pairing, out_scale, False), precision, blocks)[0]


def sigmoid_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    logits: tuple[float, float],
    n: int,
    offset: int | None,
    precision: str,
    blocks: Blocks | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`product.sigmoid_rows`, W in memory: (D k, the sum of softplus(-eps S) over the tile, the sum of D)."""
    g, _, loss, d_sum = run(q, k, sigmoid_job(q, logits, n, offset, False), precision, blocks)
    return g, loss.sum(), d_sum.sum()


def sigmoid_rows_and_columns(
    q: torch.Tensor,
    k: torch.Tensor,
    logits: tuple[float, float],
    n: int,
    offset: int | None,
    precision: str,
    blocks: Blocks | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`sigmoid_rows` and D^T q from the same D: (D k, D^T q, the sum of softplus(-eps S), the sum of D)."""
    g, g_cols, loss, d_sum = run(q, k, sigmoid_job(q, logits, n, offset, True), precision, blocks)
    return g, g_cols, loss.sum(), d_sum.sum()


def sigmoid_job(q: torch.Tensor, logits: tuple[float, float], n: int, offset: int | None, columns: bool) -> Job:
    """The sigmoid's Job for S = s q k^T + beta (logits = (s, beta)): no vectors to read."""
    dummy = q.new_empty(0)
    return Job(SIGMOID, (logits[0], offset, float(logits[1]), 1.0 / n, 1.0), (dummy, dummy, dummy), columns)


def infonce_job(scale: float, pairing: Pairing, out_scale: float, columns: bool) -> Job:
    """The InfoNCE's Job for S = s q k^T: the pairing's normalisers and positives, no sigmoid logits."""
    vectors = (pairing.lse_q, pairing.lse_k, pairing.diag_coef)
    return Job(INFONCE, (scale, pairing.offset, 0.0, 0.0, float(out_scale)), vectors, columns)
