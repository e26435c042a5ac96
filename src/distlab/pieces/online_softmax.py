"""The online max/sum fold: a log-sum-exp computed one tile at a time, never holding the whole row.

For a row x split into tiles x^(1), x^(2), ..., keep a running max m and a running sum
l = sum exp(x - m). Folding in a tile t:

    m' = max(m, max_j t_j),   l' = l exp(m - m') + sum_j exp(t_j - m'),   and at the end LSE = m + log l.

Every exponent is <= 0, so nothing overflows however large the logits get. The same fold serves the
streamed contrastive step (log-normalisers of S = s Z_x Z_y^T over T x T tiles) and ring attention
(partial softmaxes over key/value blocks that arrive one at a time): one implementation, imported by both.

Attention needs one thing more than the sums: an output accumulator o = sum_j exp(x_j - m) v_j kept
under the same running max, so when m grows to m' it is rescaled by exp(m - m'), the factor that
rescales l (`rescale`). Two partial folds of disjoint parts of a row (from two ranks, say) merge the
same way: m = max(m_1, m_2), l = l_1 exp(m_1 - m) + l_2 exp(m_2 - m) (`merge`). And attention needs
the weights exp(t_j - m') themselves: `online_fold` leaves them in the tile it consumes, so ring
attention reads them there instead of exponentiating twice.
"""

from __future__ import annotations

import torch


def rescale(run_max: torch.Tensor, new_max: torch.Tensor) -> torch.Tensor:
    """exp(m - m'): what a sum (or an output accumulator) kept under the running max m is multiplied
    by when the max becomes m' >= m. At the start m = -inf and the factor is 0."""
    return torch.exp(run_max - new_max)


def online_fold(
    run_max: torch.Tensor, run_sum: torch.Tensor, tile: torch.Tensor, dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold a tile (consumed in place) into the running (m, l) along `dim`; returns the new (m, l).
    Afterwards the tile holds the weights exp(t - m'), m' the new max."""
    new_max = torch.maximum(run_max, tile.amax(dim))
    run_sum.mul_(rescale(run_max, new_max)).add_(tile.sub_(new_max.unsqueeze(dim)).exp_().sum(dim))
    return new_max, run_sum


def merge(
    max_1: torch.Tensor, sum_1: torch.Tensor, max_2: torch.Tensor, sum_2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The folds (m_1, l_1) and (m_2, l_2) of two disjoint parts of a row, merged into the fold of both:
    m = max(m_1, m_2), l = l_1 exp(m_1 - m) + l_2 exp(m_2 - m), each sum rescaled to the larger max."""
    new_max = torch.maximum(max_1, max_2)
    return new_max, sum_1 * rescale(max_1, new_max) + sum_2 * rescale(max_2, new_max)
