"""Exercise 22: a rank's own rows of the symmetric InfoNCE, local x global (read
lessons/22_contrastive_local_naive.py first; check your answer with `pytest --exercises -k 22`; add
`--hint-level 1`, 2 or 3 for help).

Rank r holds C pairs (its local Z_x and Z_y, C x d) and the gathered N x d embeddings of every rank, rank
0's pairs first; `offset` = r C is where its pairs sit among the N. Write `local_clip_loss`: rank r's C rows
of the symmetric loss over S = s Z_x Z_y^T, averaged over them,

    L_r = 1/(2C) sum_{i = offset}^{offset + C - 1} [ -log softmax(S[i, :])_i - log softmax(S[:, i])_i ],

so that the mean of the ranks' L_r is the global loss. Build no N x N tensor: rank r needs only its rows of
S and its rows of S^T (column i of S), C x N each; the judge sees every tensor you make. It also checks L_r
against one process's whole logits, the mean over ranks against the global loss, and the gradient the
plain gather lets through (float64).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: F401  (you will need it)


def local_clip_loss(
    local_z_x: torch.Tensor,
    local_z_y: torch.Tensor,
    all_z_x: torch.Tensor,
    all_z_y: torch.Tensor,
    s: float | torch.Tensor,
    offset: int,
) -> torch.Tensor:
    """This rank's C rows of the symmetric loss, averaged over them (C x N logits, not N x N)."""
    raise NotImplementedError("not written yet: local_clip_loss(local_z_x, local_z_y, all_z_x, all_z_y, s, offset)")
