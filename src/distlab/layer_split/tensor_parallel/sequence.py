"""Sequence parallelism: between the tensor-parallel regions the block's activations are cut along the
sequence, so LayerNorm, dropout and the residual adds run on seq / P tokens per rank instead of
repeating the same whole-sequence work on every rank.

The block is `blocks.ParallelBlock` built with `operators.sequence_parallel` (f-bar, g-bar: all-gather
forward / reduce-scatter backward, and the reverse) and given rank r's part of x, of the masks and of
the target. What changes besides the operators: a parameter used on the sequence-cut activations (both
LayerNorms' gain and bias, the row-parallel layers' biases) sees only seq / P tokens on each rank, so its
gradient is a partial sum: one all-reduce over the tensor-parallel group after backward
(`reduce_sequence_parallel_grads`) makes it whole, 6 d values in all.

Dropout is exact because the masks are not drawn on the ranks: `model.dropout_masks` draws the whole
batch's masks from (seed, step), and each rank keeps its sequence part (`seq_part`), so the reference
sees exactly the masks the ranks applied.
"""

from __future__ import annotations

import torch
from torch import nn

from distlab.layer_split.tensor_parallel.operators import Comm, all_reduce
from distlab.proof.training import reduce_gradients

SEQ_DIM = 1


def seq_part(x: torch.Tensor | None, rank: int, world_size: int) -> torch.Tensor | None:
    """Rank r's contiguous part of the sequence (dim 1) of x (N, seq, d); None stays None."""
    return None if x is None else x.chunk(world_size, dim=SEQ_DIM)[rank].contiguous()


def sequence_cut_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The parameters applied to sequence-cut activations: every LayerNorm's, and what a split layer holds
    whole (its `SPLIT` says None: the row-parallel biases, added after the exit operator); in the block
    ln1, ln2, attn.out.bias, mlp.fc2.bias, 6 d values."""
    found = []
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        whole = [n for n, dim in getattr(module, "SPLIT", {}).items() if dim is None]
        if isinstance(module, nn.LayerNorm):
            whole = [n for n, _ in module.named_parameters()]
        found += [(prefix + n, getattr(module, n)) for n in whole]
    return found


def reduce_sequence_parallel_grads(model: nn.Module, comm: Comm) -> None:
    """After backward: those parameters' gradients summed over the tensor-parallel group, in one
    message (their partial sums over each rank's tokens add up to the whole sequence's)."""
    if not comm.sequence_parallel:
        return
    params = [p for _, p in sequence_cut_parameters(model)]
    reduce_gradients(params, lambda flat: all_reduce(flat, comm.group, comm.ledger, "gradients"))
