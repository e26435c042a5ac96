"""Exercise 11: a rank's own rows of the symmetric InfoNCE, local x global (read
lessons/11_contrastive_local_naive.py first; check your answer with `pytest --exercises -k 11`).

Rank r holds C pairs (its local Z_x and Z_y, C x d) and the gathered N x d embeddings of every rank.
Write `local_clip_loss`: rank r's C rows of the symmetric loss over S = s Z_x Z_y^T, averaged over them,

    L_r = 1/(2C) sum_{i = rC}^{rC + C - 1} [ -log softmax(S[i, :])_i - log softmax(S[:, i])_i ],

with C x N logits, never N x N: rows of S are s z_x,i Z_y^T, and column i of S is row i of S^T,
s z_y,i Z_x^T. The positive of local row i sits at global column offset + i, offset = r C (not at i: the
all-gather puts rank 0's pairs first). The global loss is the mean of the ranks' L_r.

Hints:
- `torch.nn.functional.cross_entropy(logits, labels)` is the mean of -log softmax(logits)[label];
- the labels are `torch.arange(offset, offset + C)`;
- the scale s multiplies the logits (s = 1 / tau).
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
    raise NotImplementedError(
        "not written yet: local_clip_loss(...), the mean over your C rows of the "
        "row and the column cross-entropy of S, positives at offset + i"
    )
