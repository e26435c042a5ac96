"""Precision in the streamed step: which dtype the loss machinery computes in, and how G goes back.

Under `torch.autocast` the towers run in bf16 (or fp16), and their embeddings may come out in bf16,
or in float32 when a tower ends in `.float()` or a LayerNorm; the two towers may even differ. The
step then:

- computes the normalisers a, b, the loss, G and dL/ds in float32, or in float64 when either
  embedding is float64 (a float64 model), with autocast off: bf16 logits would round s z_x . z_y
  (about 14 at tau = 0.07) to a step of 0.06, and the loss (4.6452) to 4.625;
- gathers each embedding in its own dtype when the two agree (bf16 halves the bytes on the wire)
  and upcasts after; upcasting bf16 or fp16 to float32 is exact, so this loses nothing;
- hands G to the backward in each embedding's own dtype, and dL/ds in the scale's dtype, as
  autograd itself would.

The gradients then differ from a float32 model's only by what the towers' bf16 arithmetic does.
Measured (tests/test_streamed_wrappers.py: bf16 autocast on CPU, P = 2, N = 64, towers returning
float32): the whole gradient, all parameters as one vector, is 3.9e-3 (relative) from the float32
model's, against 4.3e-3 to 4.9e-3 for plain autograd under the same autocast (which rounds its logits
to bf16); the loss is within 7e-5 of plain autograd's. The tests hold the step to "no further than
plain autograd" and to 1e-2.
"""

from __future__ import annotations

from typing import ContextManager

import torch


def compute_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """float64 if any embedding is float64, else float32 (bf16, fp16 and float32 all compute in it)."""
    return torch.float64 if torch.float64 in dtypes else torch.float32


def full_precision(device: torch.device) -> ContextManager:
    """Autocast off for the loss machinery: its matmuls run in the dtype of their operands."""
    return torch.autocast(device_type=device.type, enabled=False)


def surrogate_multiplier(reduction_factor: float, grad_scaler, like: torch.Tensor) -> torch.Tensor:
    """The factor every VJP is multiplied by: the wrapper's reduction factor (its average becomes
    the sum over ranks), times the GradScaler's scale when one is given (scaler.scale(loss) would
    have multiplied the loss by it). A 0-dim tensor in `like`'s dtype and device."""
    factor = torch.full((), reduction_factor, dtype=like.dtype, device=like.device)
    if grad_scaler is not None:
        factor = grad_scaler.scale(factor).to(like.dtype)
    return factor
