"""What every kernel shares, as `@triton.jit` helpers: an S tile computed in registers, the tile products at
the step's matmul precision, and a log1p accurate for the sigmoid loss.

An S tile is s q k^T for a block of BLOCK_M rows of q and BLOCK_N rows of k, accumulated over d in blocks of
BLOCK_D (so any d: a BLOCK_M x d block of q never has to fit in registers; masks cover N, C and d that are not
multiples of the blocks). The scale s multiplies the accumulated dot products, never the inputs: for bf16
embeddings the tile is then exactly the float32-upcast S up to the order of the sums.

How `tl.dot` multiplies (`MATMUL_PRECISION`, the PRECISION code): IEEE float32 (the non-tensor-core path),
TF32 (10-bit mantissas in, float32 accumulation), BF16 (both operands rounded to bf16, float32 accumulation: a
bf16 product is exact in float32), F64 (float64 embeddings: float64 throughout, the dtype that checks
exactness). Triton's CPU interpreter (TRITON_INTERPRET=1, triton 3.9) multiplies bf16 operands of `tl.dot` as
their raw 16-bit patterns, so under it BF16 becomes BF16_WIDENED: operands rounded to bf16, then widened to
float32 for the dot, which is the same arithmetic (products exact, sums in float32); and TF32 is IEEE there.

Arguments travel as named tuples (`Operand`, `Tiling`); a `Tiling`'s fields are compile-time constants (the
launcher wraps them in `tl.constexpr`), so each combination compiles once.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import triton
import triton.language as tl

IEEE, TF32, BF16, F64, BF16_WIDENED = 0, 1, 2, 3, 4  # PRECISION codes (`launch.precision_code`)


class Operand(NamedTuple):
    """A row-major matrix a kernel reads: its first element, its number of rows (rows past it read as zeros) and
    the distance between rows (a view of the gathered N x 2d keeps its stride of 2d); unit stride along d."""

    ptr: Any
    rows: Any
    stride: Any


class Tiling(NamedTuple):
    """A launch's compile-time shape: BLOCK_M x BLOCK_N tiles of S, d in slices of BLOCK_D, how tl.dot
    multiplies (PRECISION), and what the kernel does with each tile (ROLE: the kernel's own switch)."""

    BLOCK_M: tl.constexpr
    BLOCK_N: tl.constexpr
    BLOCK_D: tl.constexpr
    PRECISION: tl.constexpr
    ROLE: tl.constexpr


@triton.jit
def operand(x, PRECISION: tl.constexpr):
    """x as `tl.dot` takes it: rounded to bf16 (BF16; BF16_WIDENED then widens it back), float64 (F64), else
    float32 (a bf16 or fp16 embedding widened exactly)."""
    if PRECISION == 2:
        x = x.to(tl.bfloat16)
    elif PRECISION == 4:
        x = x.to(tl.bfloat16).to(tl.float32)
    elif PRECISION == 3:
        x = x.to(tl.float64)
    else:
        x = x.to(tl.float32)
    return x


@triton.jit
def dot(a, b, acc, PRECISION: tl.constexpr):
    """acc + a @ b for operands prepared by `operand`, accumulated in acc's dtype (float32, or float64)."""
    if PRECISION == 1:
        acc = tl.dot(a, b, acc, input_precision="tf32")
    elif PRECISION == 0 or PRECISION == 4:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)  # bf16 x bf16 on the tensor cores, or float64
    return acc


@triton.jit
def s_tile(q, k, rows, cols, d, scale, T: Tiling):
    """S = s q[rows] k[cols]^T, BLOCK_M x BLOCK_N, summed over d in slices of BLOCK_D (any d: only a
    BLOCK_M x BLOCK_D slice of q and a BLOCK_D x BLOCK_N slice of k^T are loaded at a time). Rows past q.rows
    and columns past k.rows read zeros; the caller masks what they become."""
    acc = tl.zeros((T.BLOCK_M, T.BLOCK_N), tl.float64 if T.PRECISION == 3 else tl.float32)
    row_at = q.ptr + rows[:, None].to(tl.int64) * q.stride
    col_at = k.ptr + cols[None, :].to(tl.int64) * k.stride
    for d0 in range(0, d, T.BLOCK_D):
        dd = d0 + tl.arange(0, T.BLOCK_D)
        q_slice = tl.load(row_at + dd[None, :], mask=(rows[:, None] < q.rows) & (dd[None, :] < d), other=0.0)
        k_slice = tl.load(col_at + dd[:, None], mask=(cols[None, :] < k.rows) & (dd[:, None] < d), other=0.0)
        acc = dot(operand(q_slice, T.PRECISION), operand(k_slice, T.PRECISION), acc, T.PRECISION)
    return acc * scale


@triton.jit
def log1p(x, TERMS: tl.constexpr):
    """log(1 + x) for 0 <= x <= 1 with full relative precision however small x is: 2 atanh(z) with
    z = x / (2 + x) <= 1/3, by its series 2 z sum_k z^(2k) / (2k + 1), TERMS + 1 terms (8 give float32's
    precision, 17 float64's). No log, so no cancellation in 1 + x and no approximate log near 1."""
    z = x / (2.0 + x)
    z2 = z * z
    p = tl.zeros_like(z) + 1.0 / (2 * TERMS + 1)
    for i in tl.static_range(TERMS):
        p = p * z2 + 1.0 / (2 * (TERMS - 1 - i) + 1)
    return 2.0 * z * p
