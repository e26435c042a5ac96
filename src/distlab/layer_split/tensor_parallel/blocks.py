"""The transformer block split across P ranks: the MLP column then row, attention by heads.

MLP: fc1 column parallel (rank r holds d_ff / P hidden units), GELU on the slice, fc2 row parallel:

    z = g( GELU( f(u) A_1,r^T + b_1,r ) A_2,r^T ) + b_2        one all-reduce forward (g), one backward (f)

Attention: q, k, v column parallel with h / P whole heads per rank (the rows of a head are contiguous,
so chunk r of the rows is heads r h/P .. (r+1) h/P - 1); attention runs head by head on the rank that
holds the head, untouched; the output projection row parallel over those heads' columns:

    o = g( concat_{heads of r}(softmax(q k^T / sqrt(d_h)) v) W_o,r^T ) + b_o    again one all-reduce each way

The pair (enter, exit) is a `Comm`: (f, g) for tensor parallelism, (f-bar, g-bar) for sequence
parallelism, where the block's input and output are cut along the sequence and the LayerNorms, dropout
and residual adds run on seq / P tokens per rank. The code of the block is the same for both. The split
Linear layers are the library's unless a `Layers` pair says otherwise (lesson 08 builds the block from its
own).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from distlab.layer_split.tensor_parallel.layers import LIBRARY_LAYERS, Layers
from distlab.layer_split.tensor_parallel.operators import Comm
from distlab.proof.models import MLP, Attention, Block, attend, masked


def check_split(heads: int, ffn: int, world_size: int, seq: int | None = None) -> None:
    """Bad splits are refused the same way on every rank, before any collective, naming the flag."""
    if heads % world_size:
        raise ValueError(f"--heads: {heads} heads do not split over P = {world_size} ranks (P must divide h)")
    if ffn % world_size:
        raise ValueError(f"--ffn-width: d_ff = {ffn} does not split over P = {world_size} ranks (P must divide d_ff)")
    if seq is not None and seq % world_size:
        raise ValueError(
            f"--seq-len: seq = {seq} does not split over P = {world_size} ranks "
            "(sequence parallelism needs P to divide seq)"
        )


class ParallelMLP(nn.Module):
    def __init__(self, full: MLP, rank: int, world_size: int, comm: Comm, layers: Layers = LIBRARY_LAYERS):
        super().__init__()
        self.comm = comm
        self.fc1 = layers.column(full.fc1, rank, world_size)
        self.fc2 = layers.row(full.fc2, rank, world_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = F.gelu(self.fc1(self.comm.to_parallel(x)))  # (N, seq, d_ff / P)
        return self.comm.from_parallel(self.fc2(hidden)) + self.fc2.bias


class ParallelAttention(nn.Module):
    def __init__(self, full: Attention, rank: int, world_size: int, comm: Comm, layers: Layers = LIBRARY_LAYERS):
        super().__init__()
        self.comm, self.head_dim, self.options = comm, full.head_dim, full.options
        self.q, self.k, self.v = (layers.column(lin, rank, world_size) for lin in (full.q, full.k, full.v))
        self.out = layers.row(full.out, rank, world_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.comm.to_parallel(x)  # one f for q, k and v: their input gradients add up before it
        heads = attend(self.q(x), self.k(x), self.v(x), self.head_dim, self.options)  # (N, seq, h/P * d_h)
        return self.comm.from_parallel(self.out(heads)) + self.out.bias


class ParallelBlock(nn.Module):
    """`distlab.proof.models.Block` on P ranks; the LayerNorms replicated; masks are this rank's part of them."""

    def __init__(self, full: Block, rank: int, world_size: int, comm: Comm, layers: Layers = LIBRARY_LAYERS):
        super().__init__()
        self.ln1, self.ln2 = (nn.LayerNorm(ln.normalized_shape).to(ln.weight.dtype) for ln in (full.ln1, full.ln2))
        self.ln1.load_state_dict(full.ln1.state_dict())
        self.ln2.load_state_dict(full.ln2.state_dict())
        self.attn = ParallelAttention(full.attn, rank, world_size, comm, layers)
        self.mlp = ParallelMLP(full.mlp, rank, world_size, comm, layers)

    def forward(self, x: torch.Tensor, masks: tuple | None = None) -> torch.Tensor:
        m1, m2 = masks if masks is not None else (None, None)
        y = x + masked(self.attn(self.ln1(x)), m1)
        return y + masked(self.mlp(self.ln2(y)), m2)
