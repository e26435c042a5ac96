"""The unsplit block and the batch every tensor-parallel check compares against (lesson 08).

The block is `distlab.proof.models.Block` (the one transformer block of the library) with causal attention,
separate q, k, v projections (each cut by heads on its own) and torch's fused attention: on x of shape
(N, seq, d), h heads of width d_h = d / h, an MLP of width d_ff,

    y = x + m_1 * Attention(LN_1(x))         Attention(u) = concat_heads(softmax(q k^T / sqrt(d_h)) v) W_o^T + b_o
    z = y + m_2 * MLP(LN_2(y))               MLP(u) = GELU(u W_1^T + b_1) W_2^T + b_2

m_1, m_2 are dropout masks (0 or 1/(1-p) per element), passed in rather than drawn inside, so a split
block and this one can be handed the very same masks (`dropout_masks`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from distlab.proof.models import Block, BlockOptions, token_batch
from distlab.proof.sizes import Transformer

OPTIONS = BlockOptions(causal=True, fused_qkv=False, sdpa=True)


@dataclass(frozen=True)
class BlockConfig:
    """One block of sizes `model` (the library's size record, a `Transformer` of one layer: width d, h heads,
    MLP width d_ff) on N sequences of seq tokens; dropout probability p."""

    model: Transformer = Transformer(layers=1, dim=24, heads=12, ffn=48)
    batch: int = 12
    seq: int = 12
    dropout: float = 0.1
    seed: int = 0
    dtype: torch.dtype = torch.float64

    def __post_init__(self):
        if self.model.layers != 1 or self.model.vocab:
            raise ValueError(f"a block is one layer and no vocabulary, got {self.model}")


def build(cfg: BlockConfig) -> tuple[Block, torch.Tensor, torch.Tensor]:
    """The block, drawn from `cfg.seed`, the whole batch x (N, seq, d) and a regression target of the
    same shape, drawn from `cfg.seed + 1`."""
    block = Block(cfg.model.dim, cfg.model.heads, cfg.model.ffn, OPTIONS, seed=cfg.seed, dtype=cfg.dtype)
    return block, *token_batch(cfg.batch, cfg.seq, cfg.model.dim, seed=cfg.seed + 1, dtype=cfg.dtype)


def dropout_masks(cfg: BlockConfig, step: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Step `step`'s two masks over the WHOLE batch and sequence, drawn from (seed, step) alone: every
    rank draws the same ones and keeps its part, the reference uses all of them (None if p = 0)."""
    if cfg.dropout == 0:
        return None
    gen = torch.Generator().manual_seed(1000 * cfg.seed + step + 1)
    shape = (cfg.batch, cfg.seq, cfg.model.dim)
    return tuple(
        (torch.rand(shape, generator=gen, dtype=cfg.dtype) >= cfg.dropout).to(cfg.dtype) / (1 - cfg.dropout)
        for _ in range(2)
    )


def regression_loss(out: torch.Tensor, target: torch.Tensor, count: int) -> torch.Tensor:
    """sum (z - t)^2 / count: with count = N seq d over the whole batch, a mean; on a rank holding a
    part, its share of that mean (the shares add up to the whole loss)."""
    return ((out - target) ** 2).sum() / count
