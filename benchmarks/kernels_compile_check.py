"""Compile every Triton kernel of the streamed step for an H100 (sm_90) on a machine without a GPU, with
Triton's own compiler and the ptxas it ships, and report each variant's registers, spills and shared memory.

    python benchmarks/kernels_compile_check.py        # a minute or a few; exits 1 if a variant fails

What it proves: the kernels' Python, their block sizes and their layouts compile to sm_90 machine code (wgmma
on the tensor cores for bf16 and TF32) within an H100's 227 KiB of shared memory, and how many bytes of
registers each spills (the bf16 defaults do: chosen by time on a GPU, `launch.py`). What it cannot: that they
run correctly there (the interpreter tests do that, on the same code) or how fast (`kernels_gpu.py`). The
GPU image's Triton may differ from this one. How: Triton asks its active driver for the target, so a stand-in
driver answers "cuda, sm_90, warp 32" and `JITFunction.warmup` compiles without launching (tensors on the
meta device give the argument types).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.driver import CudaDriver
from triton.runtime import driver

from distlab.streamed.kernels.coefficients import coefficient_kernel, default_gemm_blocks
from distlab.streamed.kernels.launch import Blocks, default_blocks, tiling
from distlab.streamed.kernels.lse import COLUMNS, FROM_MEMORY, ROWS, fold_blocks, lse_kernel
from distlab.streamed.kernels.product import INFONCE, SIGMOID, product_kernel
from distlab.streamed.kernels.register_tile import BF16, IEEE, TF32, Operand
from distlab.streamed.kernels.s_in_memory import in_place_kernel, pass_blocks


class Hopper(CudaDriver):
    """Triton's CUDA driver, answering for an sm_90 device that is not there (nothing is launched)."""

    def __init__(self):  # no CUDA library to load
        pass

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


def ptxas_report(ptx: str) -> tuple[int, int]:
    """(registers a thread, spill-store bytes) from the ptxas Triton ships (-v), for sm_90a."""
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    ptxas = next(p for p in (os.path.join(bin_dir, n) for n in ("ptxas-blackwell", "ptxas")) if os.path.exists(p))
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        said = subprocess.run([ptxas, "-arch=sm_90a", "-v", f.name, "-o", os.devnull], capture_output=True, text=True)
    regs, spills = (
        re.findall(r"Used (\d+) registers", said.stderr),
        re.findall(r"(\d+) bytes spill stores", said.stderr),
    )
    if not regs:
        raise RuntimeError(said.stderr[-500:])
    return int(regs[0]), int(spills[0])


def compile_one(kernel, role: int, code: int, blocks: Blocks, dtype: torch.dtype) -> dict:
    """One variant at one rank's shape of N = 65,536, P = 8, d = 1,024 (C = 8,192)."""
    meta = torch.device("meta")
    q, k = (torch.empty(rows, 1024, dtype=dtype, device=meta) for rows in (8192, 65536))
    v = torch.empty(8192, device=meta)
    operands = (Operand(q, 8192, 1024), Operand(k, 65536, 1024))
    s = torch.empty(8192, 8192, device=meta)  # one ring visit's float32 S (KERNELS "triton-s")
    if kernel is lse_kernel and role >= FROM_MEMORY:  # the fold reading S: q's pointer is S, k names its columns
        args = (Operand(s, 8192, 8192), Operand(s, 8192, 0), (v,) * 5, (0, 8192, 1.0, 0))
    elif kernel is lse_kernel:
        args = (*operands, (v,) * 5, (1024, 8192, 1.0, 0))
    elif kernel is in_place_kernel:  # W over S: bf16 into S's own bytes (row stride 2 n_k), else S's elements
        w = s.view(torch.bfloat16) if code == BF16 else s
        args = (Operand(s, 8192, 8192), Operand(w, 8192, w.shape[1]), (v, v), (v,) * 3, (1.0, 0, 0.0, 1.0))
    elif kernel is coefficient_kernel:  # W for 2,048 rows of q (one chunk), in bf16 or float32
        w = torch.empty(2048, 65536, dtype=torch.bfloat16 if code == BF16 else torch.float32, device=meta)
        args = (*operands, (w, v, v), (v,) * 3, (1024, 1.0, 0, 0.0, 1.0))
    else:
        args = (*operands, (v,) * 3, (v,) * 3, (1024, 8192, 1.0, 0, 0.0, 1.0, 1.0))
    compiled = kernel.warmup(
        *args, tiling(blocks, code, role), grid=(1,), num_warps=blocks.warps, num_stages=blocks.stages
    )
    regs, spills = ptxas_report(compiled.asm["ptx"])
    return dict(regs=regs, spills=spills, shared=compiled.metadata.shared, wgmma=compiled.asm["ptx"].count("wgmma"))


def main() -> int:
    driver.set_active(Hopper())
    variants = [
        (name, kernel, role, code, dtype)
        for code, dtype in ((BF16, torch.bfloat16), (TF32, torch.float32), (IEEE, torch.float32))
        for name, kernel, role in (
            ("row fold", lse_kernel, ROWS),
            ("row + column fold (ring)", lse_kernel, COLUMNS),
            ("InfoNCE product", product_kernel, INFONCE),
            ("sigmoid product", product_kernel, SIGMOID),
            ("InfoNCE coefficients (mm)", coefficient_kernel, INFONCE),
            ("sigmoid coefficients (mm)", coefficient_kernel, SIGMOID),
            ("row + column fold of S (s)", lse_kernel, COLUMNS + FROM_MEMORY),
            ("InfoNCE W over S (s)", in_place_kernel, INFONCE),
            ("sigmoid W over S (s)", in_place_kernel, SIGMOID),
        )
    ]
    failed = 0
    print(f"Triton {triton.__version__}, target sm_90; N = 65,536, P = 8, d = 1,024; the default blocks")
    for name, kernel, role, code, dtype in variants:
        blocks = default_blocks(code, False, sigmoid=kernel is product_kernel and role == SIGMOID)
        if kernel is lse_kernel:
            blocks = fold_blocks(code, False, role == COLUMNS)
        if kernel is in_place_kernel or kernel is lse_kernel and role >= FROM_MEMORY:
            blocks = pass_blocks(code, False)
        if kernel is coefficient_kernel:
            blocks = default_gemm_blocks(code, False, role)
        try:
            got = compile_one(kernel, role, code, blocks, dtype)
        except Exception as err:  # noqa: BLE001 - every variant is tried; the failures are counted
            failed += 1
            print(f"FAIL {name:26s} {['ieee', 'tf32', 'bf16'][code]:5s} {type(err).__name__}: {str(err)[:200]}")
            continue
        too_big = got["shared"] > 227 * 1024  # an H100's shared memory per block: more cannot launch
        failed += too_big
        precision = {IEEE: "float32", TF32: "tf32", BF16: "bf16"}[code]
        print(
            f"{'FAIL' if too_big else 'ok  '} {name:26s} {precision:7s} {blocks.m}x{blocks.n}x{blocks.d} "
            f"w{blocks.warps} s{blocks.stages}: {got['regs']} registers, {got['spills']} B spilled, "
            f"{got['shared'] // 1024} KiB shared, {got['wgmma']} wgmma"
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
