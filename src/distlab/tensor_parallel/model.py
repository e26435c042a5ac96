"""The unsplit transformer block every tensor-parallel check compares against (lesson 08).

A pre-LayerNorm block on x of shape (N, seq, d), h heads of width d_h = d / h, an MLP of width d_ff:

    y = x + m_1 * Attention(LN_1(x))         Attention(u) = concat_heads(softmax(q k^T / sqrt(d_h)) v) W_o^T + b_o
    z = y + m_2 * MLP(LN_2(y))               MLP(u) = GELU(u W_1^T + b_1) W_2^T + b_2

m_1, m_2 are dropout masks (0 or 1/(1-p) per element), passed in rather than drawn inside, so a split
block and this one can be handed the very same masks (`dropout_masks`). Attention is causal.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class BlockConfig:
    """N sequences of seq tokens of width d; h heads; MLP width d_ff; dropout probability p."""

    batch: int = 12
    seq: int = 12
    dim: int = 24
    heads: int = 12
    ffn: int = 48
    dropout: float = 0.1
    seed: int = 0
    dtype: torch.dtype = torch.float64


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Causal attention of (N, seq, heads * d_h) projections, head by head; whatever the number of
    heads the tensors hold (all h, or one rank's h / P): the heads never mix."""
    n, seq = q.shape[:2]
    split = [t.reshape(n, seq, -1, head_dim).transpose(1, 2) for t in (q, k, v)]  # (N, heads, seq, d_h)
    out = F.scaled_dot_product_attention(*split, is_causal=True)
    return out.transpose(1, 2).reshape(n, seq, -1)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.head_dim = dim // heads
        self.q, self.k, self.v, self.out = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(attend(self.q(x), self.k(x), self.v(x), self.head_dim))


class MLP(nn.Module):
    def __init__(self, dim: int, ffn: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, ffn), nn.Linear(ffn, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


def masked(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Dropout with a given mask (None: no dropout)."""
    return x if mask is None else x * mask


class Block(nn.Module):
    def __init__(self, cfg: BlockConfig):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(cfg.dim), nn.LayerNorm(cfg.dim)
        self.attn, self.mlp = Attention(cfg.dim, cfg.heads), MLP(cfg.dim, cfg.ffn)

    def forward(self, x: torch.Tensor, masks: tuple | None = None) -> torch.Tensor:
        m1, m2 = masks if masks is not None else (None, None)
        y = x + masked(self.attn(self.ln1(x)), m1)
        return y + masked(self.mlp(self.ln2(y)), m2)


def build(cfg: BlockConfig) -> tuple[Block, torch.Tensor, torch.Tensor]:
    """The block (LayerNorm gains and biases drawn too, so their gradients are not trivial), the
    whole batch x (N, seq, d) and a regression target of the same shape."""
    gen = torch.Generator().manual_seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    block = Block(cfg).to(cfg.dtype)
    with torch.no_grad():
        for ln in (block.ln1, block.ln2):
            ln.weight.copy_(1 + 0.1 * torch.randn(cfg.dim, generator=gen, dtype=cfg.dtype))
            ln.bias.copy_(0.1 * torch.randn(cfg.dim, generator=gen, dtype=cfg.dtype))
    shape = (cfg.batch, cfg.seq, cfg.dim)
    x = torch.randn(shape, generator=gen, dtype=cfg.dtype)
    target = torch.randn(shape, generator=gen, dtype=cfg.dtype)
    return block, x, target


def dropout_masks(cfg: BlockConfig, step: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Step `step`'s two masks over the WHOLE batch and sequence, drawn from (seed, step) alone: every
    rank draws the same ones and keeps its part, the reference uses all of them (None if p = 0)."""
    if cfg.dropout == 0:
        return None
    gen = torch.Generator().manual_seed(1000 * cfg.seed + step + 1)
    shape = (cfg.batch, cfg.seq, cfg.dim)
    return tuple(
        (torch.rand(shape, generator=gen, dtype=cfg.dtype) >= cfg.dropout).to(cfg.dtype) / (1 - cfg.dropout)
        for _ in range(2)
    )


def regression_loss(out: torch.Tensor, target: torch.Tensor, count: int) -> torch.Tensor:
    """sum (z - t)^2 / count: with count = N seq d over the whole batch, a mean; on a rank holding a
    part, its share of that mean (the shares add up to the whole loss)."""
    return ((out - target) ** 2).sum() / count
