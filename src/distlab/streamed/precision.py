"""The step's matmul precision, a choice in its config (MATMUL_PRECISION), never an ambient flag.

torch reads two process-wide settings when it multiplies float32 matrices on a GPU:
`torch.backends.cuda.matmul.allow_tf32` and `torch.set_float32_matmul_precision` (open_clip's training entry
point turns TF32 on whenever CUDA is available; "medium" also lets the CPU's oneDNN use bf16). Either would
silently turn the step's float32 tiles into TF32 or bf16 ones. So the step pins its own setting around its
tiles and gives the caller's back afterwards:

    "float32"  float32 products ("highest", TF32 off): the default, and the only one the tests hold to 1e-5
    "tf32"     TF32 products with float32 accumulation ("high"): 10-bit mantissas in, on GPUs only
    "bf16"     the embeddings rounded to bf16, products accumulated in float32. For bf16 embeddings S is then
               the float32-upcast S up to the order of the sums (a bf16 product is exact in float32); the
               Triton kernels also round the coefficient tile to bf16 for their second product, W k (as
               FlashAttention rounds P before P V), the torch tiles keep it in float32

Float64 embeddings multiply in float64 whatever the key says: that is the dtype that checks exactness.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

TORCH_SETTING = {"float32": "highest", "tf32": "high", "bf16": "highest"}  # bf16 rounds the inputs instead


@contextmanager
def pinned(precision: str, device_type: str) -> Iterator[None]:
    """Inside: autocast off and torch's float32 matmul precision as MATMUL_PRECISION says; the caller's
    settings (both flags) as they were afterwards, whatever happens inside."""
    saved = torch.get_float32_matmul_precision(), torch.backends.cuda.matmul.allow_tf32
    torch.set_float32_matmul_precision(TORCH_SETTING[precision])
    torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
    try:
        with torch.autocast(device_type, enabled=False):
            yield
    finally:
        torch.set_float32_matmul_precision(saved[0])
        torch.backends.cuda.matmul.allow_tf32 = saved[1]


def rounded(z: torch.Tensor, precision: str) -> torch.Tensor:
    """z as the torch tiles multiply it: rounded to bf16 (and back to its dtype) under "bf16", else z."""
    return z.to(torch.bfloat16).to(z.dtype) if precision == "bf16" and z.dtype != torch.float64 else z
