"""The symmetric InfoNCE (CLIP) loss: the global reference, and the rows one rank owns; and the
sigmoid (SigLIP) loss's global reference.

With embeddings Z_x, Z_y (N x d, unit-norm in CLIP) and the logit scale s = 1/tau > 0 (tau the
temperature; a constant, or learned), S = s Z_x Z_y^T and

    L = 1/(2N) * sum_i [ -log softmax_row(S)_ii - log softmax_col(S)_ii ],

the mean over the global batch N of the x->y and y->x cross-entropies with the positives on the
diagonal. `cross_entropy` works through log-softmax (a log-sum-exp that subtracts the row maximum),
so s = 100 (tau = 0.01), where logits reach 100, is as stable in float32 as s = 1. Every loss here
takes s, not tau: a learned scale (open_clip's exp(logit_scale)) passes straight in.

Under data parallelism rank r owns rows r*C ... r*C + C - 1 of S (C = N / P). Its local loss uses
those rows of S (x->y) and the same rows of S^T (y->x), averaged over its C rows. Its positives sit
at column r*C + i, not on the diagonal of its C x N block. The mean of the P local losses
is the global loss, which is why DDP's gradient *averaging* is the right reduction for it.

The sigmoid loss (SigLIP) makes each of the N^2 pairs its own binary classification: S = s Z_x Z_y^T +
beta with a learned bias beta, eps_ij = +1 on the diagonal and -1 elsewhere,

    L = -(1/N) sum_ij log sigma(eps_ij S_ij),

no normaliser over a row or column. `sigmoid_loss` is plain autograd over the whole N x N (the
reference the streamed step's closed form, src/distlab/streamed/sigmoid.py, is checked against).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def check_scale(s: float | torch.Tensor) -> None:
    if not bool(torch.as_tensor(s) > 0):  # also rejects NaN
        raise ValueError(f"the logit scale s = 1/tau must be > 0, got {float(s)}")


def clip_loss(z_x: torch.Tensor, z_y: torch.Tensor, s: float | torch.Tensor) -> torch.Tensor:
    """The symmetric InfoNCE over all N pairs with logits s Z_x Z_y^T (the reference everything
    else is checked against); `s` may be a tensor that requires grad (a learned scale)."""
    check_scale(s)
    if z_x.shape != z_y.shape or z_x.dim() != 2:
        raise ValueError(f"z_x and z_y must both be N x d, got {tuple(z_x.shape)} and {tuple(z_y.shape)}")
    logits = s * z_x @ z_y.T
    labels = torch.arange(len(z_x), device=z_x.device)
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2


def local_clip_loss(
    local_z_x: torch.Tensor,
    local_z_y: torch.Tensor,
    all_z_x: torch.Tensor,
    all_z_y: torch.Tensor,
    s: float | torch.Tensor,
    offset: int,
) -> torch.Tensor:
    """This rank's C rows of the symmetric loss, averaged over them (C x N logits, not N x N).

    `offset` = rank * C is where this rank's positives sit among the N columns.
    """
    check_scale(s)
    labels = torch.arange(offset, offset + len(local_z_x), device=local_z_x.device)
    logits_x = s * local_z_x @ all_z_y.T  # rows of S
    logits_y = s * local_z_y @ all_z_x.T  # the same rows of S^T
    return (F.cross_entropy(logits_x, labels) + F.cross_entropy(logits_y, labels)) / 2


def sigmoid_loss(
    z_x: torch.Tensor, z_y: torch.Tensor, s: float | torch.Tensor, beta: float | torch.Tensor
) -> torch.Tensor:
    """The sigmoid loss over all N pairs, plain autograd; s and beta may be tensors that require grad."""
    check_scale(s)
    if z_x.shape != z_y.shape or z_x.dim() != 2:
        raise ValueError(f"z_x and z_y must both be N x d, got {tuple(z_x.shape)} and {tuple(z_y.shape)}")
    eps = 2 * torch.eye(len(z_x), dtype=z_x.dtype, device=z_x.device) - 1  # +1 positives, -1 negatives
    return -F.logsigmoid(eps * (s * z_x @ z_y.T + beta)).sum() / len(z_x)
