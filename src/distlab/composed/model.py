"""The transformer lesson 12 trains, its stages, and its data.

A decoder-only language model over a vocabulary of V tokens, built from the ground floor's block
(`distlab.proof.models.Block`: pre-LayerNorm, causal attention, q, k, v apart, an MLP of width d_ff):

    h_0 = E[tokens] + PE(positions)          E: V x d embedding; PE the fixed sinusoidal encoding
    h_l = Block_l(h_{l-1}),  l = 1 .. L
    logits = LN(h_L) W_head^T                W_head: V x d, no bias
    loss = mean over every position of -log softmax(logits)[next token]

The positional encoding has no parameters (PE[t, 2i] = sin(t / 10000^(2i/d)), PE[t, 2i+1] = the cos):
a rank that holds some of the positions (context and sequence parallelism) adds the rows of its own
positions (`place`), and nothing about positions needs a gradient or a collective.

Key bias. The blocks' k projection has no bias: q (k + b) = q k + q b adds the same q b to every score of
a query's row, and a softmax does not see a constant added to its row, so dL/db_k is exactly zero. In
floating point it is rounding (1e-17), and AdamW divides the step by sqrt(v) + eps: a gradient of 1e-17
moves the bias by about lr 1e-17 / 1e-8 = 1e-11 a step, in a direction the rounding picks. Two exact
computations that round differently then disagree at 1e-11 on a parameter the model does not use, so
it is dropped (as Llama drops every bias).

Stages. Pipeline stage p of pp keeps blocks p L/pp .. (p+1) L/pp - 1; the first stage also the embedding,
the last the final norm and the head (`keep_stage`). The blocks stay in a ModuleDict keyed by their index
in the whole model, so every parameter keeps its whole-model name on every stage: "layers.5.attn.q.weight"
is the same name at pp = 1, 2 and 4, which is what lets a checkpoint saved at one shape load at another.

Data. A token stream from a fixed random Markov chain on V tokens (each token's successor drawn from its
own distribution, most of the mass on a few tokens): the model can learn something real, and its loss has
a floor, the chain's entropy rate. Step k's N sequences of seq + 1 tokens come from (seed, k) alone, so
any shape, and a run resumed at step k, sees the same batches.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from distlab.composed.config import RunConfig
from distlab.proof.models import Block, BlockOptions

OPTIONS = BlockOptions(causal=True, fused_qkv=False, sdpa=True)
SHARPNESS = 2.5  # the chain's logits are SHARPNESS N(0, 1): a few likely successors per token


def sinusoid(positions: torch.Tensor, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """PE[t] for each position t: (len(positions), d), sin on even columns, cos on odd ones."""
    freq = torch.exp(torch.arange(0, dim, 2, dtype=torch.float64) * (-math.log(10000.0) / dim))
    angle = positions.to(torch.float64).unsqueeze(1) * freq
    return torch.stack([angle.sin(), angle.cos()], dim=-1).flatten(1).to(dtype)


class LanguageModel(nn.Module):
    """tokens (n, seq) -> logits (n, seq, V); any of embed, norm, head may be None (a middle stage)."""

    def __init__(self, cfg: RunConfig):
        super().__init__()
        m, gen = cfg.model, torch.Generator().manual_seed(cfg.seed)
        self.embed = nn.Embedding(m.vocab, m.dim, dtype=cfg.dtype)
        with torch.no_grad():
            self.embed.weight.normal_(generator=gen)
        blocks = (Block(m.dim, m.heads, m.ffn, OPTIONS, cfg.seed + 1 + i, cfg.dtype) for i in range(m.layers))
        self.layers = nn.ModuleDict({str(i): block for i, block in enumerate(blocks)})
        for block in self.layers.values():
            if not m.key_bias:  # its gradient is zero (module docstring)
                block.attn.k.register_parameter("bias", None)
        self.norm = nn.LayerNorm(m.dim, dtype=cfg.dtype)
        with torch.no_grad():
            self.norm.weight.copy_(1 + 0.1 * torch.randn(m.dim, generator=gen, dtype=cfg.dtype))
            self.norm.bias.copy_(0.1 * torch.randn(m.dim, generator=gen, dtype=cfg.dtype))
        self.head = nn.Linear(m.dim, m.vocab, bias=False, dtype=cfg.dtype)
        with torch.no_grad():
            self.head.weight.uniform_(-(m.dim**-0.5), m.dim**-0.5, generator=gen)
        self.dim, self.dtype = m.dim, cfg.dtype
        self.place(torch.arange(cfg.seq))

    def place(self, positions: torch.Tensor) -> None:
        """The positions this rank's embedding output holds, in order: their PE rows, not a parameter and
        not saved (each shape places its own)."""
        self.register_buffer("pe", sinusoid(positions, self.dim, self.dtype), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x) + self.pe  # token ids in, (n, seq, d) out
        for block in self.layers.values():
            x = block(x)
        if self.head is not None:
            x = self.head(self.norm(x))
        return x


def keep_stage(model: LanguageModel, stage: int, stages: int) -> LanguageModel:
    """Cut `model` down to pipeline stage `stage` of `stages`, in place: its blocks; the embedding on the first
    stage, the final norm and the head on the last. Names stay the whole model's."""
    per = len(model.layers) // stages
    for name in list(model.layers):
        if not stage * per <= int(name) < (stage + 1) * per:
            del model.layers[name]
    if stage > 0:
        model.embed = None
    if stage < stages - 1:
        model.norm = model.head = None
    return model


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy, the mean over every position of (n, seq, V) logits against (n, seq) next tokens."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def chain(cfg: RunConfig) -> torch.Tensor:
    """The Markov chain's V x V transition probabilities (row t: the distribution of t's successor)."""
    gen = torch.Generator().manual_seed(10_000 + cfg.seed)
    return torch.softmax(
        SHARPNESS * torch.randn(cfg.model.vocab, cfg.model.vocab, generator=gen, dtype=torch.float64), dim=1
    )


def entropy_rate(cfg: RunConfig) -> float:
    """The chain's entropy per token, in nats, under its stationary distribution: the loss's floor."""
    transitions = chain(cfg)
    stationary = torch.linalg.matrix_power(transitions, 256)[0]
    return -(stationary.unsqueeze(1) * transitions * transitions.log()).sum().item()


def token_batch(cfg: RunConfig, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step `step`'s (tokens, targets), (N, seq) each: N sequences walked on the chain from uniform starts;
    the targets are the tokens shifted by one."""
    gen = torch.Generator().manual_seed(1_000_000 * (cfg.seed + 1) + step)
    transitions = chain(cfg)
    walk = torch.empty(cfg.batch, cfg.seq + 1, dtype=torch.long)
    walk[:, 0] = torch.randint(cfg.model.vocab, (cfg.batch,), generator=gen)
    for t in range(cfg.seq):
        walk[:, t + 1] = torch.multinomial(transitions[walk[:, t]], 1, generator=gen).squeeze(1)
    return walk[:, :-1].clone(), walk[:, 1:].clone()
