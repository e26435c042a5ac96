"""Exercise 15: the sigmoid ring by hand (read lessons/15_sigmoid_and_ring.py first; check your answer
with `pytest --exercises -k 15`).

Write `ring_by_hand(rt, x, y, s, beta)`: rank r holds its C x d image embeddings x = z^x_r and text
embeddings y = z^y_r (float64). Return (G_x for my C rows, G_y for my C pairs, bytes this rank sent) of the
sigmoid loss over the global batch of N = P C pairs, with no rank ever holding another rank's x or more
than a few C x d blocks:

    S = s Z_x Z_y^T + beta,  eps = +1 on the diagonal, -1 elsewhere,  L = -(1/N) sum_ij log sigma(eps_ij S_ij)
    D = -(1/N) eps sigma(-eps S),   G_x = s D Z_y,   G_y = s D^T Z_x

At step k = 0 .. P-1 rank r holds rank j = (r - k) mod P's text block y_j: it sends y_j on to r + 1 and
receives the next block from r - 1 (posted *before* the math that reads y_j, k < P - 1 only), adds
s D_rj y_j into its G_x (D_rj: the C x C block of D, rows of r, columns of j; eps has its +1s only when
j = r), and adds s D_rj^T x into a traveling accumulator for block j (the sum of what ranks j, j + 1, ...,
r - 1 added, received from r - 1), which it sends on to r + 1. After P sends the accumulator of block r is
back on rank r: G_y for my pairs. With P = 1 nothing is sent.

Bytes sent per rank: (P - 1) C d feature elements + P C d accumulator elements (8 bytes each in float64),
0 at P = 1.

Hints:
- `distlab.comm.p2p.post([(t, dst)], [(buf, src)], ledger=ledger)` posts a send and a receive at once
  and returns; `.wait()` returns `[buf]`, filled (the lesson's way; a `distlab.comm.ledger.Ledger`
  counts what you send, `ledger.sent`). Plain `dist.isend(t, dst)` / `dist.irecv(buf, src)` do too:
  `req.wait()` before you read `buf` or change `t`;
- keep the accumulator you send and the one you receive in different tensors;
- t.nbytes is a tensor's size in bytes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist  # noqa: F401  (you will need it)


def ring_by_hand(rt, x: torch.Tensor, y: torch.Tensor, s: float, beta: float):
    """(G_x, G_y for my pairs, bytes sent) of the sigmoid loss, text blocks and accumulators on a ring."""
    raise NotImplementedError(
        "not written yet: ring_by_hand(rt, x, y, s, beta), text blocks passed to "
        "r + 1 and a traveling G_y accumulator that comes home after P hops"
    )
