"""Two promises a GPU does not keep by default: float32 means float32, and the same run gives the same bits.

float32. On an NVIDIA GPU since Ampere, torch may run float32 matmuls and convolutions on the tensor cores
in TF32: the inputs rounded to a 10-bit mantissa (relative error about 5e-4 per product, where float32's
is 6e-8), the accumulation in float32. Two switches decide it, and their defaults differ:
`torch.backends.cuda.matmul.allow_tf32` (False) for matmuls, `torch.backends.cudnn.allow_tf32` (True) for
cuDNN's convolutions. So a convolutional tower in "float32" computes in TF32 unless told otherwise, and a
check at float32's tolerance (rtol 1e-5) can fail for no fault of the code it checks. Lesson 27 did on
an H100 (torch 2.11): step 1's image-tower gradients 1.55e-4 from the reference, its text tower (no
convolution) 6e-7; the step runs the towers on micro-batches of 64, the reference on the whole batch of
256, and other shapes get other cuDNN kernels, rounded differently.
`exact_float32()` turns both off for a block and restores the caller's settings after it: a comparison
states its precision, it does not inherit an ambient flag.
(The CPU has no TF32: there it changes nothing.)

The same bits. The claims that a resumed run is bit-identical to an uninterrupted one (lessons 07 and
16) need every kernel to add in the same order twice. On the CPU torch's kernels do. On CUDA some do
not: atomic adds (index_add_, scatter_add_, the backward of an embedding), cuDNN's autotuner picking
another algorithm, cuBLAS splitting a sum across a workspace shared by streams. `deterministic(device)`
makes them: `torch.use_deterministic_algorithms(True, warn_only=True)` (a kernel with no deterministic
version then warns, naming itself, where it would differ in silence; raising would stop a lesson over an op
its claim may not even touch), cuDNN's deterministic algorithms without the autotuner, and cuBLAS's
workspace configuration CUBLAS_WORKSPACE_CONFIG=:4096:8 (cuBLAS reads it when it first runs, so it is set
before any matmul: `distributed(..., deterministic=True)` enters this before anything runs on the GPU).
On the CPU it does nothing. Both are context managers and restore what they found.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

CUBLAS_WORKSPACE = ":4096:8"  # cuBLAS's documented setting for reproducible results (or ":16:8")


@contextmanager
def exact_float32() -> Iterator[None]:
    """float32 matmuls and cuDNN convolutions in IEEE float32 (no TF32) inside the block."""
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn


@contextmanager
def deterministic(device: torch.device) -> Iterator[None]:
    """On a CUDA `device`: deterministic kernels where torch has them, cuDNN without its autotuner, cuBLAS's
    reproducible workspace; elsewhere nothing."""
    if device.type != "cuda":
        yield
        return
    before = (
        (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
        os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
    )
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)  # a caller's own setting stays
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0][0], warn_only=before[0][1])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[1:3]
        if before[3] is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
