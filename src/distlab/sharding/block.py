"""A small pre-LayerNorm transformer block, attention written out (no fused kernel), for lesson 07's
memory accounting beside the MLP: x + Attn(LN(x)), then + MLP(LN(.)) with a 4 d hidden layer.

Shapes: x is (C, seq, d); h heads of d / h; the attention scores are (C, h, seq, seq).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, d: int = 16, heads: int = 2, seed: int = 0, dtype: torch.dtype = torch.float64):
        super().__init__()
        torch.manual_seed(seed)  # (only parameter initialisation draws from it here)
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d, dtype=dtype), nn.LayerNorm(d, dtype=dtype)
        self.qkv, self.proj = nn.Linear(d, 3 * d, dtype=dtype), nn.Linear(d, d, dtype=dtype)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d, dtype=dtype), nn.Linear(4 * d, d, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c, seq, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(c, seq, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = torch.softmax(q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5, dim=-1)  # (C, h, seq, seq)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(c, seq, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


def block_batch(rows: int, seq: int, d: int, seed: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.randn(rows, seq, d, generator=gen, dtype=dtype),
        torch.randn(rows, seq, d, generator=gen, dtype=dtype),
    )
