"""Exercise 14: the streamed five-phase step (read lessons/14_streamed_five_phase.py first; check your answer
with `pytest --exercises -k 14`).

Write `streamed_backward(ddp, local_x, local_y, cfg, tau)`: add the exact gradient of the global symmetric
InfoNCE into .grad (like loss.backward()) and return L, never making anything N x N, C x N or B x N. The
model under DDP returns (z_x, z_y) or (z_x, z_y, s); tau None means the model's own scale s, which then gets
its gradient too. `cfg` (distlab.streamed.config.StreamConfig) holds N = cfg.n, P = cfg.world, T = cfg.t,
this rank's rows cfg.offset ... cfg.offset + C - 1 and its micro-batches cfg.micro (local slices).

    phase 1  no_grad, per micro-batch: save the random state, z = model(x, y); all-gather Z_x | Z_y (N x 2d)
    phase 2  a_i = log sum_j exp S_ij, b_j = log sum_i exp S_ij over T x T tiles of S = s Z_x Z_y^T
             L = 1/(2N) sum_i (a_i + b_i - 2 S_ii)
    phase 3  per micro-batch: G_x,i = s/(2N) sum_j (R_ij + Q_ij - 2 delta_ij) z_j^y, G_y the same with S^T,
             R_ij = exp(S_ij - a_i), Q_ij = exp(S_ij - b_j); dL/ds = (1/s) sum_i z_i^x . G_x,i (its rows)
    phase 4  recompute the micro-batch with a graph under its saved random state; backward of
             P <(z_x, z_y, s), (G_x, G_y, dL/ds)> (DDP averages over P ranks, the gradient is their sum)
    phase 5  DDP reduces: every micro-batch's backward but the last inside ddp.no_sync()

Hints:
- `distlab.online_softmax.online_fold(run_max, run_sum, tile, dim=1)` folds a tile into a running max and sum:
  start at -inf and 0, and the log-sum-exp is run_max + run_sum.log();
- `distlab.chunks.chunks(n, t)` cuts 0 ... n-1 into slices of at most t;
- `distlab.random_state.RandContext(x, y)` records the random state; `with state:` replays it;
- `dist.all_gather_single(out, mine)` gathers every rank's rows in rank order;
- `torch.autograd.backward(outputs, grads)` back-propagates several outputs at once.
"""

from __future__ import annotations

import torch
import torch.distributed as dist  # noqa: F401  (you will need them)

from distlab.chunks import chunks  # noqa: F401
from distlab.online_softmax import online_fold  # noqa: F401
from distlab.random_state import RandContext  # noqa: F401


def streamed_backward(ddp, local_x: torch.Tensor, local_y: torch.Tensor, cfg, tau: float | None) -> float:
    """The five phases: add the exact gradient of the global loss into .grad (like loss.backward());
    return L. tau None: the model returns its logit scale s third, and s gets its gradient too."""
    raise NotImplementedError(
        "not written yet: streamed_backward(ddp, local_x, local_y, cfg, tau): phase 1 "
        "the no-grad forward and the all-gather, phase 2 a, b and L in T x T tiles, then "
        "per micro-batch G (phase 3), the recompute and P times its VJP (phase 4), "
        "no_sync but the last (phase 5)"
    )
