"""Launching the kernels: the precision code, block sizes, how the columns are split across programs, and the
launch itself (counted by `distlab.proof.launch_count`; on the meta device counted and not run).

Block sizes. `tl.dot` needs every side >= 16. bf16 (tensor cores), chosen by timing on an H100 (Triton 3.6;
one rank of N = 65,536, P = 8, d = 1,024; benchmarks/results/gpu/2026-11-26-kernels-h100, `kernels_gpu.py
--sweep`): InfoNCE 128 x 256 tiles of S, d in slices of 64, 8 warps, 3 stages of software pipelining (0.035 s
a step, against 0.053 s in 128 x 128 and 0.093 s in 128 x 64); the sigmoid's product 128 x 128 x 64 (0.046 s,
against 0.092 s in 128 x 64 x 32). Both spill registers (240-1,256 bytes a thread, `kernels_compile_check.py`)
and are still the fastest measured. float32 (IEEE, no tensor cores): 64 x 64, d in slices of 32, 8 warps; TF32:
the same with 4 warps; neither spills. Under the interpreter 32 x 32 x 32 (its cost is per program
and per op, not per element); the tests pass 16 x 16 x 16 and several column ranges where they need block edges
crossed.

Column splits. A program owns BLOCK_M rows and walks a range of columns; at one rank's shape of P = 8
(C = 8,192 rows, BLOCK_M = 128) that is 64 programs, half an H100's 132 SMs. So the columns are cut into
`splits` ranges (grid = row blocks x splits, at least two programs per SM in whole waves: `whole_waves`), each
range writes its own partial
(m, l) or G, and the partials are combined in a fixed order after the launch: deterministic, no atomics.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton.language as tl

from distlab.proof.launch_count import record_kernel
from distlab.streamed.kernels.register_tile import BF16, BF16_WIDENED, F64, IEEE, TF32, Tiling

PRECISIONS = {"float32": IEEE, "tf32": TF32, "bf16": BF16}


@dataclass(frozen=True)
class Blocks:
    """A launch configuration: the tile of S (m x n), the slice of d per dot (d), warps and pipeline stages; for
    the fused kernels how many ranges the columns are split in, for the coefficient kernel how many rows of W
    one chunk holds."""

    m: int
    n: int
    d: int
    warps: int
    stages: int
    splits: int | None = None  # column ranges (None: from the device, `column_split`)
    w_rows: int | None = None  # KERNELS "triton-mm": rows of W per chunk (None: from a budget, `coefficients`)


def interpreted(kernel) -> bool:
    """Whether `kernel` runs under Triton's CPU interpreter (TRITON_INTERPRET=1 when it was decorated)."""
    return type(kernel).__name__ == "InterpretedFunction"


def precision_code(precision: str, dtype: torch.dtype, interpreting: bool) -> int:
    """How tl.dot multiplies: float64 embeddings in float64 whatever MATMUL_PRECISION says (the dtype that
    checks exactness), else MATMUL_PRECISION's float32, tf32 or bf16 (under the interpreter bf16 as
    BF16_WIDENED, tf32 as float32: see `register_tile`)."""
    if dtype == torch.float64:
        return F64
    code = PRECISIONS[precision]
    if interpreting:
        return {BF16: BF16_WIDENED, TF32: IEEE}.get(code, code)
    return code


def accumulator(code: int) -> torch.dtype:
    """The dtype the kernels keep sums and statistics in."""
    return torch.float64 if code == F64 else torch.float32


def default_blocks(code: int, interpreting: bool, sigmoid: bool = False) -> Blocks:
    """Block sizes for sm_90, chosen by measurement and register count: see the module docstring."""
    if interpreting:
        return Blocks(32, 32, 32, 1, 1)
    if code == BF16:  # the sigmoid's softplus series needs registers: d in slices of 32 leaves them
        return Blocks(128, 128, 64, 8, 3) if sigmoid else Blocks(128, 256, 64, 8, 3)
    if code == IEEE:  # float32 FMA products: 8 warps keep the 64 x 64 tile in 128 registers a thread
        return Blocks(64, 64, 32, 8, 2)
    return Blocks(64, 64, 32, 4, 2)


def tiling(blocks: Blocks, code: int, role: int) -> Tiling:
    """The compile-time constants of a launch, each wrapped as Triton's constexpr."""
    return Tiling(*(tl.constexpr(v) for v in (blocks.m, blocks.n, blocks.d, code, role)))


def column_split(n_q: int, n_k: int, blocks: Blocks, device: torch.device) -> tuple[int, int]:
    """(columns per split, splits): `blocks.splits`, else on CUDA as many as fill whole waves of the device's
    SMs (`whole_waves`; one range elsewhere: the interpreter runs programs one after another), every split a
    whole number of column blocks and none empty."""
    row_blocks, col_blocks = math.ceil(n_q / blocks.m), math.ceil(n_k / blocks.n)
    splits = blocks.splits
    if splits is None:
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 0
        splits = whole_waves(row_blocks, sms) if sms else 1
    splits = max(1, min(splits, col_blocks))
    per_split = math.ceil(col_blocks / splits) * blocks.n
    return per_split, math.ceil(n_k / per_split)


def whole_waves(row_blocks: int, sms: int) -> int:
    """Column ranges s such that the row_blocks s programs fill whole waves of `sms` SMs: the fewest s giving at
    least two programs per SM whose last wave is at least 90% full, else the fullest last wave among up to twice
    that many. (At C = 8,192 in 128-row blocks on 132 SMs: s = 6, 384 programs in 2.9 waves; the earlier
    "about two per SM", s = 5, left 320 programs in 2.4 waves, the last 42% full.)"""
    least = max(1, math.ceil(2 * sms / row_blocks))

    def fill(s: int) -> float:
        programs = row_blocks * s
        return programs / (sms * math.ceil(programs / sms))

    options = range(least, 2 * least + 1)
    full = [s for s in options if fill(s) >= 0.9]
    return min(full) if full else max(options, key=fill)


def launch(kernel, grid: tuple, args: tuple, blocks: Blocks, moved_bytes: int) -> None:
    """kernel[grid](*args), counted; on the meta device counted only (there is nothing to run)."""
    record_kernel(getattr(kernel, "fn", kernel).__name__, moved_bytes)
    tensors = [a for group in args for a in (group if isinstance(group, tuple) else (group,))]
    if any(isinstance(t, torch.Tensor) and t.device.type == "meta" for t in tensors):
        return
    kernel[grid](*args, num_warps=blocks.warps, num_stages=blocks.stages)


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)
