"""An all-to-all against one process: uneven splits, forward and backward, checked exactly.

Rank s sends (s + 2q) mod 3 rows to rank q (so some parts are empty, and no two ranks send alike), rows of
3 float64 values drawn from the seed s, and every rank back-propagates an upstream gradient of its own.
Every rank can rebuild every rank's rows and gradients, so the expected results need no communication:

    forward, rank r:   cat_s (part r of rank s's rows)                       (rank order)
    backward, rank r:  cat_q (rows of rank q's upstream gradient that came from rank r)

An all-to-all only moves values, so the check is equality, bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from distlab.processes.identity import Runtime

ROW = 3  # values in a row


def uneven_counts(world: int) -> list[list[int]]:
    """counts[s][q]: rows rank s sends rank q."""
    return [[(s + 2 * q) % 3 for q in range(world)] for s in range(world)]


def _rows(n: int, salt: int) -> torch.Tensor:
    return torch.randn(n, ROW, generator=torch.Generator().manual_seed(salt), dtype=torch.float64)


def check_all_to_all(
    rt: Runtime, run: Callable[[torch.Tensor, list[int], list[int]], torch.Tensor], by_hand: bool = False
) -> tuple[bool, bool]:
    """(forward exact, backward exact) of y = run(x, send_counts, recv_counts) on this rank: its autograd
    backward, or (`by_hand`, a run with no autograd) run again on the upstream gradient, counts swapped."""
    p, r, counts = rt.world_size, rt.rank, uneven_counts(rt.world_size)
    received = [sum(counts[s][q] for s in range(p)) for q in range(p)]
    xs, upstream = [_rows(sum(counts[s]), s) for s in range(p)], [_rows(received[q], 100 + q) for q in range(p)]
    want_y = torch.cat([xs[s].split(counts[s])[r] for s in range(p)])
    want_dx = torch.cat([upstream[q].split([counts[s][q] for s in range(p)])[r] for q in range(p)])
    send, recv = counts[r], [counts[s][r] for s in range(p)]
    x, dy = xs[r].clone().to(rt.device).requires_grad_(not by_hand), upstream[r].to(rt.device)
    y = run(x, send, recv)
    if by_hand:
        dx = run(dy, recv, send)
    else:
        y.backward(dy)
        dx = x.grad
    return torch.equal(y.detach().cpu(), want_y), torch.equal(dx.cpu(), want_dx)
