"""The whole sequence in one process: what lessons 09 and 11 split, and the answer they are checked against.

Both lessons draw q, k, v and an upstream gradient dout, each (h, seq, d_h), from one seed, the same on every
rank; each rank computes its part of out = softmax(q k^T / sqrt(d_h)) v and of dq, dk, dv, and the lesson
compares them with torch's `scaled_dot_product_attention` run on the whole sequence with plain autograd: an
independent reference, none of the lessons' code in it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def inputs(seed: int, heads: int, seq_len: int, head_dim: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """q, k, v and dout of the whole sequence, drawn on the CPU from `seed` (the same on every rank)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn((heads, seq_len, head_dim), generator=gen, dtype=dtype) for _ in range(4)]


def reference(inputs: list[torch.Tensor], causal: bool) -> dict[str, torch.Tensor]:
    """out, dq, dk, dv of the whole sequence by SDPA and plain autograd, backward from inputs[3] (dout)."""
    q, k, v = (t.clone().requires_grad_() for t in inputs[:3])
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    out.backward(inputs[3])
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
