"""Attention one tile at a time: the forward folds each key/value tile into running statistics, the
backward recomputes each tile's probabilities from the saved log-sum-exp (as FlashAttention does).

For one query piece q (h x n_q x d_h) and the key/value tiles k_t, v_t it meets, with scores
A_t = q k_t^T / sqrt(d_h) (masked entries -inf), keep per query row a running max m, sum l and
output accumulator o (all under the same max):

    m' = max(m, rowmax A_t),   l' = l exp(m - m') + rowsum exp(A_t - m'),
    o' = o exp(m - m') + exp(A_t - m') v_t,

and at the end  out = o / l,  lse = m + log l  (the row log-sum-exp of all the scores). The (m, l)
update is `distlab.pieces.online_softmax.online_fold`, the very function that gives the streamed contrastive
step its log-normalisers; it leaves exp(A_t - m') in the tile, and o is rescaled by the same
exp(m - m') (`rescale`).

Backward, per tile, from the saved lse and delta = rowsum(dout * out):

    omega = exp(A_t - lse) (the softmax restricted to the tile, exactly, since lse is final),
    dv_t += omega^T dout,   dA = omega * (dout v_t^T - delta),   dq += dA k_t / sqrt(d_h),   dk_t += dA^T q / sqrt(d_h).

No tile needs any other: the sequence is never whole anywhere.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from distlab.pieces.online_softmax import online_fold, rescale


@dataclass
class Partial:
    """One query piece's running statistics: max m and sum l (h x n_q), output o (h x n_q x d_h)."""

    run_max: torch.Tensor
    run_sum: torch.Tensor
    out: torch.Tensor

    @classmethod
    def start(cls, out: torch.Tensor) -> Partial:
        """m = -inf, l = 0, and o accumulated in place in `out` (zeroed here), a view into the output."""
        run_max = torch.full(out.shape[:-1], float("-inf"), dtype=out.dtype, device=out.device)
        return cls(run_max, torch.zeros_like(run_max), out.zero_())

    def finish(self, lse: torch.Tensor) -> None:
        """out = o / l in place; lse = m + log l written into `lse`."""
        self.out.div_(self.run_sum.unsqueeze(-1))
        torch.add(self.run_max, self.run_sum.log_(), out=lse)


def causal_mask(queries: range, keys: range, device: torch.device) -> torch.Tensor:
    """True where key position j > query position i (masked): the mask of a tile whose kind
    (`distlab.layer_split.context_parallel.split.tile_kind`) is diagonal; a full tile needs none, a skipped one
    no math."""
    q_pos = torch.arange(queries.start, queries.stop, device=device)
    k_pos = torch.arange(keys.start, keys.stop, device=device)
    return k_pos.unsqueeze(0) > q_pos.unsqueeze(1)


def scores(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """A = q k^T / sqrt(d_h), masked entries -inf."""
    tile = q @ k.transpose(-1, -2) * (1 / math.sqrt(q.shape[-1]))
    return tile if mask is None else tile.masked_fill_(mask, float("-inf"))


def fold_tile(part: Partial, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> None:
    """Fold one key/value tile into the query piece's running (m, l, o)."""
    tile = scores(q, k, mask)
    old_max = part.run_max
    part.run_max, part.run_sum = online_fold(old_max, part.run_sum, tile, dim=-1)  # tile := exp(A - m')
    part.out.mul_(rescale(old_max, part.run_max).unsqueeze(-1)).add_(tile @ v)


@dataclass(frozen=True)
class Saved:
    """What one query piece's backward needs: its queries, output gradient, lse and delta."""

    q: torch.Tensor
    dout: torch.Tensor
    lse: torch.Tensor
    delta: torch.Tensor


def tile_grads(
    saved: Saved, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv): this tile's contributions, from its probabilities recomputed with the saved lse."""
    scale = 1 / math.sqrt(saved.q.shape[-1])
    weights = scores(saved.q, k, mask).sub_(saved.lse.unsqueeze(-1)).exp_()  # omega = exp(A - lse)
    dv = weights.transpose(-1, -2) @ saved.dout
    d_scores = weights.mul_(saved.dout @ v.transpose(-1, -2) - saved.delta.unsqueeze(-1))  # dA, in omega's place
    return d_scores @ k * scale, d_scores.transpose(-1, -2) @ saved.q * scale, dv
