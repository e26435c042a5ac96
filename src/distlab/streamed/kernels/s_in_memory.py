"""S in memory (KERNELS "triton-s"): each block of S made by one cuBLAS GEMM, then one memory-bound Triton pass.

The fused kernels (`lse`, `product`) and the coefficient GEMM (`coefficients`) make S in Triton's registers. On an
H200 the ring's fold ran at 104-136 TFLOP/s that way against cuBLAS's 462-515 for the products, half the ring's
time (benchmarks/results/gpu/2026-11-28-decide-h200). The fast peers make S with cuBLAS in chunks and reduce it
with a pass that only streams memory (siglip-kernel: cuBLAS S, an in-place Triton BCE, two cuBLAS products).
This module does the same for both losses, in chunks of rows of at most a budget's bytes:

    1. S_raw = q[rows] k^T: one GEMM at the step's matmul precision (`coefficients.mm_into`: cuBLAS on CUDA,
       16-bit operands accumulated in float32), kept in float32 (float64 for float64 embeddings). The scale s
       multiplies in the pass, as the kernels scale their sums (`register_tile.s_tile`).
    2. one Triton pass over the chunk:
       the fold    `lse.lse_kernel` with ROLE + FROM_MEMORY: each row's (m, l) and positive's logit, and with
                   `columns` each column's (m, l) partials; one read of S, 4 bytes an element, no dot;
       W in place  `in_place_kernel`: each element of S turned into its coefficient (`product.coefficients`:
                   R + Q - 2 delta for the InfoNCE, D for the sigmoid, whose rows' sums of softplus(v) and of D,
                   the loss and dL/dbeta, come beside it) and written over S where it lay.
    3. the products from that chunk: G[rows] = W k, and for a ring's visit W^T q[rows] added into the columns'
       product (`coefficients.mm_into`, cuBLAS, in place), as `coefficients` does with its W.

W in place under MATMUL_PRECISION "bf16". The products want bf16 W (tensor cores; the rounding `coefficients`
gives W too), which the pass writes into the first half of each float32 row of S: W_ij at bf16 position
2 n_k i + j, a bf16 view of row stride 2 n_k that cuBLAS reads as it is. W's column j lies in S's column j/2, so
a program that owns whole rows and walks their columns left to right only overwrites S it has already read; only
its first column block overwrites the block it is reading, so the pass waits for all its warps' loads
(`tl.debug_barrier`) before storing. No program reads another's rows. In float32 and float64 W takes S's own
elements, each written by the thread that read it.

The budget. At most S_BUDGET bytes of S alive at once on a GPU (W's rule and default: the config's W_MEMORY_MIB
where set, CPU_BUDGET on a CPU; `coefficients.chunk_rows`). One ring visit of float32 S at C = 8,192 is 256 MiB:
one chunk.

S once per visit. The sigmoid's visit makes S once: the pass and both products read the same chunk. The
InfoNCE ring's W needs the visiting columns' finished normalisers b_j, so its pass 2 comes after every visit's
fold; `Kept` holds the chunks pass 1 made, in visit order, while they fit in the budget, and pass 2 takes them
back instead of making S again: 3 C N d multiply-adds a rank where all of C x N fits, 4 C N d where none does.

What it costs, per element of S at width d (`path_model` prices it): 2 d FLOPs of GEMM for S (again in the
ring's pass 2 unless kept) and 4 d for the two products; the fold reads 4 bytes, the in-place pass reads 4 and
writes 2 (bf16) or 4, and the products read W again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from distlab.streamed.chunk_size import CPU_BUDGET
from distlab.streamed.kernels.coefficients import W_BUDGET, Job, chunk_rows, mm_into
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
from distlab.streamed.kernels.lse import Folded, launch_fold, lse_kernel, merge
from distlab.streamed.kernels.product import SIGMOID, coefficients, infonce_vector
from distlab.streamed.kernels.register_tile import BF16, BF16_WIDENED, Operand, Tiling

S_BUDGET = W_BUDGET  # bytes of S alive at once on a GPU: W's rule and default (config W_MEMORY_MIB where set)


@triton.jit
def in_place_kernel(s: Operand, w: Operand, sums, vectors, walk, T: Tiling):
    """W over S, one program per BLOCK_M rows walking all their columns left to right. s: the chunk of raw S
    (s.rows x w.rows, row stride s.stride); w: where W goes (its pointer's dtype, row stride w.stride);
    sums = (loss, D) row sums (sigmoid); vectors = (lse_q, lse_k, diag_coef) (InfoNCE); walk = (s, offset of
    the positives, beta, 1/N)."""
    loss_at, d_sum_at = sums
    scale, offset, bias, inv_n = walk
    rows = tl.program_id(0) * T.BLOCK_M + tl.arange(0, T.BLOCK_M)
    row_ok = rows < s.rows
    lse_q, coef = infonce_vector(vectors[0], rows, row_ok, T), infonce_vector(vectors[2], rows, row_ok, T)
    acc = tl.float64 if T.PRECISION == 3 else tl.float32
    loss_sum = tl.zeros((T.BLOCK_M,), acc)
    d_sum = tl.zeros((T.BLOCK_M,), acc)
    for c0 in range(0, w.rows, T.BLOCK_N):
        cols = c0 + tl.arange(0, T.BLOCK_N)
        col_ok = cols < w.rows
        ok = row_ok[:, None] & col_ok[None, :]
        raw = tl.load(s.ptr + rows[:, None].to(tl.int64) * s.stride + cols[None, :], mask=ok, other=0.0)
        hit = cols[None, :] == rows[:, None] + offset
        lse_k = infonce_vector(vectors[1], cols, col_ok, T)
        coef_tile, softplus = coefficients(raw * scale, hit, (lse_q, lse_k, coef), (bias, inv_n), T)
        if T.ROLE == 1:
            loss_sum += tl.sum(tl.where(ok, softplus, 0.0), 1)
            d_sum += tl.sum(tl.where(ok, coef_tile, 0.0), 1)
        if T.PRECISION == 2 or T.PRECISION == 4:  # bf16 W in S's bytes: every warp has read before any writes
            tl.debug_barrier()
        at = w.ptr + rows[:, None].to(tl.int64) * w.stride + cols[None, :]
        tl.store(at, coef_tile.to(w.ptr.dtype.element_ty), mask=ok)
    if T.ROLE == 1:
        tl.store(loss_at + rows, loss_sum, mask=row_ok)
        tl.store(d_sum_at + rows, d_sum, mask=row_ok)


def pass_blocks(code: int, interpreting: bool) -> Blocks:
    """The passes' tile: no dot, so only the memory access pattern matters: few rows (the in-place pass gives
    each program whole rows: 512 programs for a chunk of 8,192) and wide columns (1 KiB of float32 per row and
    step). Not yet timed on a GPU (docs/gpu.md: the next run times it); the interpreter's blocks elsewhere."""
    if interpreting:
        return default_blocks(code, interpreting)
    return Blocks(16, 256, 16, 4, 2)


def operands(q: torch.Tensor, k: torch.Tensor, code: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k as the GEMM multiplies them: rounded to bf16 under MATMUL_PRECISION "bf16" (the kernels round
    inside `register_tile.operand`), else as they are."""
    if code in (BF16, BF16_WIDENED):
        return q.to(torch.bfloat16), k.to(torch.bfloat16)
    return q, k


def s_chunk(q_rows: torch.Tensor, k: torch.Tensor, code: int) -> torch.Tensor:
    """The raw dot products q_rows k^T in the accumulator's dtype: one GEMM (cuBLAS on CUDA)."""
    s = torch.empty(len(q_rows), len(k), dtype=accumulator(code), device=q_rows.device)
    return mm_into(s, q_rows, k.T, add=False)


@dataclass
class Kept:
    """Chunks of S that the InfoNCE ring's pass 1 made, one per visit in visit order, for pass 2 to take back
    (S once per visit) while all of them fit in `budget` bytes. Pass 2 walks the visits in pass 1's order
    (`ring.ring_pass`); the caller names each visit by `mark` (its rows: the same tensor, unchanged, against as
    many columns), a chunk is taken back only under its own mark, and anything out of order empties the store
    (S is then made again: the same GEMM, the same numbers)."""

    budget: int | None = None  # bytes; None: S_BUDGET (CPU_BUDGET on a CPU)
    chunks: list = field(default_factory=list)
    full: bool = False  # a visit was refused: none after it is kept, so the order stays pass 1's
    key: tuple = ()  # the visit the next offer or take is for (`mark`), set by the caller

    def start(self) -> None:
        """A new pass 1 (its first visit, the rank's own block): what an earlier step kept is dropped."""
        self.chunks.clear()
        self.full = False

    def offer(self, s: torch.Tensor) -> None:
        room = self.budget or chunk_budget(s.device)
        if self.full or sum(nbytes(chunk) for _, chunk in self.chunks) + nbytes(s) > room:
            self.full = True
            return
        self.chunks.append((self.key, s))

    def take(self) -> torch.Tensor | None:
        if self.chunks and self.chunks[0][0] == self.key:
            return self.chunks.pop(0)[1]
        self.chunks.clear()
        return None

    @staticmethod
    def mark(q: torch.Tensor, n_k: int) -> tuple:
        return (q.data_ptr(), q._version, tuple(q.shape), n_k)


def chunk_budget(device: torch.device) -> int:
    """The default bytes of S alive at once on `device` (the budget `coefficients.chunk_rows` takes)."""
    return CPU_BUDGET if device.type == "cpu" else S_BUDGET


def fold_chunk(s: torch.Tensor, scale: float, offset: int | None, code: int, columns: bool, blocks: Blocks) -> Folded:
    """The fold of a chunk of raw S in memory (`lse.lse_kernel` reading it): rows' (m, l) and positives, and
    with `columns` the columns' (m, l) over these rows."""
    n_k = s.shape[1]
    chunk = Operand(s, len(s), n_k)
    return launch_fold(chunk, Operand(s, n_k, 0), (0, scale, offset), (code, columns, blocks, True), nbytes(s))


class Chunking(NamedTuple):
    """How a fold walks S: the blocks of its pass (None: `pass_blocks`), the bytes of S alive at once (None:
    `chunk_budget`), and the store that keeps a visit's S for the products (None: none kept)."""

    blocks: Blocks | None = None
    budget: int | None = None
    kept: Kept | None = None


def row_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    scale: float,
    offset: int | None,
    precision: str,
    columns: bool = False,
    chunking: Chunking | None = None,
) -> Folded:
    """`lse.row_lse` with S in memory: the fold of every row of S = s q k^T (row i's positive at column
    i + offset, None: none), chunk by chunk of at most the budget's bytes; a whole visit in one chunk is
    offered to the store of kept S."""
    blocks, budget, kept = chunking or Chunking()
    code = precision_code(precision, q.dtype, interpreted(lse_kernel))
    (q, k), blocks = operands(q, k, code), blocks or pass_blocks(code, interpreted(lse_kernel))
    itemsize, budget = torch.finfo(accumulator(code)).bits // 8, budget or chunk_budget(q.device)
    rows_per = chunk_rows(len(q), len(k), itemsize, blocks, q.device, budget)
    parts = []
    for r0 in range(0, len(q), rows_per):
        s = s_chunk(q[r0 : r0 + rows_per], k, code)
        parts.append(fold_chunk(s, scale, None if offset is None else offset + r0, code, columns, blocks))
        if kept is not None and rows_per >= len(q):
            kept.offer(s)
    folded = Folded(*(torch.cat([getattr(p, name) for p in parts]) for name in ("m", "l", "diag")))
    if columns:
        folded.col_m, folded.col_l = merge(torch.stack([p.col_m for p in parts]), torch.stack([p.col_l for p in parts]))
    return folded


def in_place(s: torch.Tensor, job: Job, r0: int, code: int, blocks: Blocks, sums: tuple) -> torch.Tensor:
    """The chunk's W over its S (`in_place_kernel`) for rows r0.. of the job's q; W as the products read it:
    S's own elements, or under bf16 a bf16 view of S's bytes (row stride 2 n_k)."""
    n_rows, n_k = s.shape
    scale, offset, *logits, _ = job.walk
    wide = code in (BF16, BF16_WIDENED)
    w_buf = s.view(torch.bfloat16) if wide else s  # the same storage: (n_rows, 2 n_k) bf16, or S itself
    lse_q, lse_k, coef = job.vectors
    vectors = (lse_q[r0 : r0 + n_rows], lse_k, coef[r0 : r0 + n_rows]) if job.role != SIGMOID else job.vectors
    offset = n_k if offset is None else offset + r0  # no positive: an offset no column reaches
    args = (Operand(s, n_rows, n_k), Operand(w_buf, n_k, w_buf.shape[1]), sums, vectors)
    args += ((float(scale), offset, *(float(x) for x in logits)), tiling(blocks, code, job.role))
    launch(in_place_kernel, (triton.cdiv(n_rows, blocks.m),), args, blocks, 2 * nbytes(s) + nbytes(*sums, *vectors))
    return w_buf[:, :n_k] if wide else s


def run(q: torch.Tensor, k: torch.Tensor, job: Job, precision: str, blocks: Blocks | None = None, kept=None):
    """`coefficients.run` with S in memory: chunk by chunk of q's rows, S by a GEMM (or taken back from `kept`),
    W over it in one pass, then W k into its rows of G and, with job.columns, W^T q[rows] added into the
    columns' product: (G for q's rows, W^T q or None, loss row sums, D row sums). `kept`: a `Kept` or None."""
    n_q, d = q.shape
    code = precision_code(precision, q.dtype, interpreted(in_place_kernel))
    (q, k), blocks = operands(q, k, code), blocks or pass_blocks(code, interpreted(in_place_kernel))
    acc = accumulator(code)
    budget = job.w_bytes or chunk_budget(q.device)
    rows_per = chunk_rows(n_q, len(k), torch.finfo(acc).bits // 8, blocks, q.device, budget)
    g = torch.empty(n_q, d, dtype=acc, device=q.device)
    g_cols = torch.zeros(len(k), d, dtype=acc, device=q.device) if job.columns else None
    loss, d_sum = torch.zeros(2, n_q if job.role == SIGMOID else 1, dtype=acc, device=q.device)
    for r0 in range(0, n_q, rows_per):
        rows = slice(r0, min(r0 + rows_per, n_q))
        s = kept.take() if kept is not None and rows_per >= n_q else None
        s = s_chunk(q[rows], k, code) if s is None else s
        sums = (loss[rows], d_sum[rows]) if job.role == SIGMOID else (loss, d_sum)
        w = in_place(s, job, r0, code, blocks, sums)
        mm_into(g[rows], w, k, add=False)
        if job.columns:
            mm_into(g_cols, w.T, q[rows], add=True)
    out_scale = job.walk[-1]
    return g.mul_(out_scale), None if g_cols is None else g_cols.mul_(out_scale), loss, d_sum
