"""The sigmoid loss (SigLIP) and its closed-form gradient, in T x T tiles on one process.

Logits with a learnable scale s and bias beta, labels eps_ij = +1 on the diagonal and -1 elsewhere (beta
and eps, not SigLIP's b and y: here b_j is a column log-sum-exp and y the second tower):

    S = s Z_x Z_y^T + beta,    L = -(1/N) sum_ij log sigma(eps_ij S_ij) = (1/N) sum_ij softplus(-eps_ij S_ij)

a mean over the N positives (open_clip's `SigLipLoss` divides each rank's sum by its C rows and lets
DDP average the P ranks, which is the same L). Every pair is its own binary problem: there is no
normaliser, so unlike InfoNCE no phase computes a log-sum-exp before the gradient. Differentiating
softplus(u) gives sigma(u), and u = -eps_ij S_ij, so with D_ij = dL/dS_ij

    D_ij = -(1/N) eps_ij sigma(-eps_ij S_ij)                 (|D_ij| < 1/N: bounded, never overflows)
    G_x = dL/dZ_x = s D Z_y,    G_y = dL/dZ_y = s D^T Z_x
    dL/ds = sum_ij D_ij z_i^x . z_j^y = sum_i z_i^x . (D Z_y)_i        (row i's share: no extra pass)
    dL/dbeta = sum_ij D_ij

Each rank adds its own rows' shares of dL/ds and dL/dbeta (and the tile math hands each rank G_x for its
rows and G_y for its columns); the wrapper's reduction sums the ranks with every other gradient.

Stability: each tile is turned into v = -eps S in place, and softplus(v) is computed as -logsigmoid(-v),
which torch evaluates as max(v, 0) + log1p(exp(-|v|)): exact for |S| in the hundreds, no threshold;
sigma itself never overflows. Nothing N x N, C x N or B x N is made:
`sigmoid_block` walks a block of rows against a block of columns in tiles of at most T x T, and each
tile yields its loss sum, D Z_y for its rows and D^T Z_x for its columns at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from distlab.pieces.chunks import chunks
from distlab.streamed.torch_tiles import diagonal_crossing


def sigmoid_tile(s_tile: torch.Tensor, row0: int, col0: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of softplus(-eps S) over the tile, D = dL/dS for the tile) for logits S whose first row is
    global pair row0 and first column col0. S is consumed (D is written into it)."""
    hit = diagonal_crossing(row0, col0, *s_tile.shape)
    v = s_tile  # v = -eps S: S off the diagonal, -S on it
    if hit:
        v[hit].diagonal().neg_()
    loss = F.logsigmoid(-v).sum().neg()  # softplus(v) = -log sigma(-v), exact for any |v|
    d = v.sigmoid_().div_(n)  # |D| = sigma(-eps S) / N
    if hit:
        d[hit].diagonal().neg_()  # D = -(1/N) eps sigma(-eps S): the sign is -eps
    return loss, d


@dataclass(frozen=True)
class Logits:
    """The affine map from a similarity to a logit, S = s z_x . z_y + beta."""

    s: float  # the logit scale
    beta: float  # the logit bias


@dataclass
class BlockGrads:
    """What one block of rows x one block of columns contributes: all sums over that block only."""

    loss_sum: torch.Tensor  # sum_ij softplus(-eps_ij S_ij)   (L = total / N)
    d_y: torch.Tensor | None  # D Z_y for the rows (G_x = s D Z_y)
    d_x: torch.Tensor | None  # D^T Z_x for the columns (G_y = s D^T Z_x)
    d_sum: torch.Tensor  # sum_ij D_ij, the block's share of dL/dbeta


def sigmoid_block(
    x: torch.Tensor,
    y: torch.Tensor,
    logits: Logits,
    starts: tuple[int, int],
    n: int,
    t: int,
    want: tuple[bool, bool] = (True, True),
) -> BlockGrads:
    """Rows x (global pairs starts[0] ...) against columns y (starts[1] ...), tiles of at most T x T.
    want = (D Z_y for the rows, D^T Z_x for the columns); what is not wanted is None and not computed."""
    kw = dict(dtype=x.dtype, device=x.device)
    loss, d_sum = torch.zeros((), **kw), torch.zeros((), **kw)
    d_y = torch.zeros_like(x) if want[0] else None
    d_x = torch.zeros_like(y) if want[1] else None
    for rows in chunks(len(x), t):
        x_scaled = x[rows] * logits.s
        for cols in chunks(len(y), t):
            s_tile = torch.addmm(torch.full((), logits.beta, **kw), x_scaled, y[cols].T)  # S = s x y^T + beta
            part, d = sigmoid_tile(s_tile, starts[0] + rows.start, starts[1] + cols.start, n)
            loss += part
            d_sum += d.sum()
            if d_y is not None:
                d_y[rows].addmm_(d, y[cols])
            if d_x is not None:
                d_x[cols].addmm_(d.T, x[rows])
    return BlockGrads(loss, d_y, d_x, d_sum)


@dataclass
class RankGrads:
    """One rank's share of a contrastive loss and of its gradients; summed over ranks they are exact."""

    loss_part: torch.Tensor  # this rank's share of L (the ranks' shares add up to L)
    g_x: torch.Tensor | None  # dL/dz_x for this rank's C rows (None: not wanted)
    g_y: torch.Tensor | None  # dL/dz_y for this rank's C columns (None: not wanted)
    g_s: torch.Tensor | None  # this rank's share of dL/ds (None: not wanted)
    g_b: torch.Tensor | None  # this rank's share of dL/dbeta (None: the loss has no bias)
