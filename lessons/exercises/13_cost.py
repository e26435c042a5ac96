"""Exercise 13: what one rank of a step holds and sends, by hand (read lessons/13_cost.py first, and
lessons 07 and 08 for the formulas; check your answer with `pytest --exercises -k 13`; add `--hint-level 1`,
2 or 3 for help).

A stack of `model.layers` transformer blocks (`distlab.proof.models.Block`: q, k, v and out projections of d x d
with biases, torch's fused causal attention, an MLP d -> d_ff -> d with biases and GELU, two LayerNorms)
trains with AdamW on N = `batch.global_batch` sequences of seq = `batch.seq` tokens, in e-byte elements,
split over P ranks as `parallel` says: data parallel (`parallel.dp` = P; every rank holds the whole model
and C = N / P sequences; after backward each block's gradient is averaged by a ring all-reduce of its flat
parameters, padded to P equal chunks), or tensor parallel (`parallel.tp` = P; q, k, v and fc1 cut by their
rows, out and fc2 by their columns, their biases whole; every rank sees all N sequences), with or without
sequence parallelism (`parallel.sp`), with or without recomputation of every block (`parallel.recompute`).

Write `rank_bytes`: return, for one rank, the bytes it holds after a step and sends in the step, exactly:

    "weights", "gradients"   the parameters this rank holds, and their gradients
    "moments"                AdamW's m and v
    "activations"            what the stack's forward keeps alive for backward, plus its output (the input
                             is data, counted by nobody: lesson 08 counts the same way, block by block)
    "sent"                   every byte this rank sends in one step (a ring: lesson 06's fractions)

The judge runs each configuration on 2 real ranks (the lesson's own runs: DDP, DDP recomputing, TP, TP + SP)
and compares your numbers with what the ranks held and sent, and with `distlab.cost`'s prediction; then with
`distlab.cost`'s alone at three more shapes (other d, d_ff, blocks, tokens, and a group of 5).
"""

from __future__ import annotations

from distlab.cost.inputs import Batch, Parallel
from distlab.proof.sizes import Transformer


def rank_bytes(model: Transformer, batch: Batch, parallel: Parallel, e: int) -> dict[str, int]:
    """What one rank holds after a step and sends in it: weights, gradients, moments, activations, sent."""
    raise NotImplementedError("not written yet: rank_bytes(model, batch, parallel, e)")
