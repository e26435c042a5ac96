"""Exercise 11: Ulysses attention (read lessons/11_ulysses.py first; check your answer with
`pytest --exercises -k 11`; add `--hint-level 1`, 2 or 3 for help).

The sequence of seq positions is split over the P ranks in contiguous blocks: this rank (r of P) holds
positions r seq/P .. (r+1) seq/P - 1 of the queries, keys and values, every head: q, k, v of shape
(h, seq/P, d_h). Write `ulysses_attention`: return this rank's rows of

    out = softmax(q k^T / sqrt(d_h) [+ the causal mask]) v      over the whole sequence, head by head,

shaped like q, by Ulysses' route: move the data so that every rank holds the whole sequence of h/P heads
(rank q: heads q h/P .. (q+1) h/P - 1), attend there with torch's scaled_dot_product_attention (causal
when `causal`), and move the result back to the sequence split. The moves are all-to-alls with equal
parts; each rank keeps 1/P of what it holds and sends the rest, so one move sends (P-1)/P of a block.

The gradients must flow back to q, k and v: the backward of an all-to-all is the reverse all-to-all.
`distlab.comm.differentiable.all_to_all(rows, send_counts, recv_counts, group, ledger, phases)` moves rows
(dim 0) with such a backward and counts the bytes in `ledger`; mind which dimension you cut and in what order
the parts arrive (from rank 0 first).

The judge (P = 3, h = 6, seq = 12) checks out and the gradients of q, k, v against SDPA on the whole
sequence in one process (float64, rtol 1e-10), causal and not, and the bytes your collectives send:
4 (P-1)/P blocks forward and as many backward, a block being h seq/P d_h values.
"""

from __future__ import annotations

import torch

from distlab.comm.ledger import Ledger


def ulysses_attention(q, k, v, causal: bool, ledger: Ledger, group=None) -> torch.Tensor:
    """Attention of this rank's positions (h, seq/P, d_h each) against the whole sequence: head split,
    SDPA on whole sequences of h/P heads, sequence split again. Differentiable."""
    raise NotImplementedError("not written yet: ulysses_attention(q, k, v, causal, ledger, group)")
