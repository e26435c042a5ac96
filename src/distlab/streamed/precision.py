"""The step's matmul precision, a choice in its config (MATMUL_PRECISION), never an ambient flag.

torch reads process-wide settings when it multiplies float32 matrices, which callers write with
`torch.backends.cuda.matmul.allow_tf32` and `torch.set_float32_matmul_precision` (open_clip's training entry
point turns TF32 on whenever CUDA is available; "medium" also lets the CPU's oneDNN multiply in bf16). Either
would silently turn the step's float32 tiles into TF32 or bf16 ones. So the step pins its own setting around
its tiles and gives the caller's back afterwards:

    "float32"  float32 products (IEEE, TF32 off): the default, and the one the tests hold to 1e-5
    "tf32"     TF32 products with float32 accumulation: 10-bit mantissas in, on GPUs only
    "bf16"     the embeddings rounded to bf16, products accumulated in float32. For bf16 embeddings S is then
               the float32-upcast S up to the order of the sums (a bf16 product is exact in float32); the
               Triton kernels also round the coefficient tile to bf16 for their second product, W k (as
               FlashAttention rounds P before P V), the torch tiles keep it in float32

Float64 embeddings multiply in float64 whatever the key says: that is the dtype that checks exactness.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch

# The per-backend settings torch's float32 matmuls read (torch >= 2.9 names them; `allow_tf32` and
# `set_float32_matmul_precision` write them): cuBLAS on GPUs, oneDNN on CPUs ("medium" sets oneDNN to bf16).
_BOTH = (torch.backends.cuda.matmul, getattr(torch.backends.mkldnn, "matmul", None))
BACKENDS = tuple(backend for backend in _BOTH if hasattr(backend, "fp32_precision"))
PINNED = {"float32": ("ieee", "ieee"), "tf32": ("tf32", "ieee"), "bf16": ("ieee", "ieee")}  # bf16 rounds the inputs


def matmul_settings() -> tuple[str, ...]:
    """What cuBLAS's and oneDNN's float32 matmuls do now ("none": torch's default, "ieee", "tf32", "bf16").
    Read per backend: after a caller mixes allow_tf32 with set_float32_matmul_precision, torch refuses to
    answer `get_float32_matmul_precision()` at all."""
    return tuple(backend.fp32_precision for backend in BACKENDS)


@contextmanager
def pinned(precision: str, device_type: str) -> Iterator[None]:
    """Inside: autocast off and the float32 matmuls as MATMUL_PRECISION says; the caller's settings as they
    were afterwards, whatever happens inside."""
    saved = matmul_settings()
    legacy = None if BACKENDS else torch.backends.cuda.matmul.allow_tf32  # a torch before 2.9: the old flag
    for backend, value in zip(BACKENDS, PINNED[precision]):
        backend.fp32_precision = value
    if not BACKENDS:
        torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
    try:
        off = torch.autocast(device_type, enabled=False) if device_type != "meta" else nullcontext()  # meta: counting
        with off:
            yield
    finally:
        for backend, value in zip(BACKENDS, saved):
            backend.fp32_precision = value
        if not BACKENDS:
            torch.backends.cuda.matmul.allow_tf32 = legacy


def rounded(z: torch.Tensor, precision: str) -> torch.Tensor:
    """z as the torch tiles multiply it: rounded to bf16 (and back to its dtype) under "bf16", else z."""
    return z.to(torch.bfloat16).to(z.dtype) if precision == "bf16" and z.dtype != torch.float64 else z
