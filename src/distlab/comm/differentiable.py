"""The all-to-all with its backward: rows sent to every rank, and their gradients sent back the same way.

Rank r holds x (rows along dim 0) and sends rows send_counts[q] of it, in order, to rank q; from rank s it
receives recv_counts[s] rows, stacked in rank order. Every rank's send_counts[q] is rank q's
recv_counts[r]: each side knows what will arrive before anything moves (expert parallelism exchanges
the counts first, Ulysses' parts are equal).

Backward. Each output row is one input row of some rank, moved: y = Pi x for a permutation-like map
Pi that is spread over the ranks. Its gradient is dL/dx = Pi^T dL/dy: every row of dL/dy goes back to
where its row came from, which is the all-to-all again with the counts swapped (rank r now sends
recv_counts[s] rows to rank s and receives send_counts[q] from rank q). No row is summed with another:
unlike the all-gather (whose backward sums) the all-to-all only moves.

`AllToAll` counts the bytes that leave the rank in `ledger`, forward and backward each under its own
phase: `distlab.comm.collectives.all_to_all_bytes`, the rows addressed to the other ranks times a row's
bytes (a rank's part for itself never leaves it). Lesson 10 writes the same Function out and proves it
equal to this one and to torch's `all_to_all_single_autograd`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from distlab.comm.collectives import all_to_all_bytes
from distlab.comm.ledger import Ledger


def _move(x: torch.Tensor, send_counts: list[int], recv_counts: list[int], group) -> torch.Tensor:
    """One all-to-all of x's rows along dim 0: send_counts[q] rows to rank q, recv_counts[s] from rank s."""
    out = x.new_empty((sum(recv_counts), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv_counts, send_counts, group=group)
    return out


def _count(ledger: Ledger | None, phase: str, x: torch.Tensor, send_counts: list[int], group) -> None:
    if ledger is not None:
        row_bytes = x[0].numel() * x.element_size() if len(x) else 0
        ledger.add(phase, "all_to_all", all_to_all_bytes(send_counts, row_bytes, dist.get_rank(group)))


class AllToAll(torch.autograd.Function):
    """all_to_all(x) forward; the reverse all_to_all (the counts swapped) backward."""

    @staticmethod
    def forward(ctx, x, send_counts: list[int], recv_counts: list[int], group, ledger, phases: tuple[str, str]):
        ctx.counts, ctx.group, ctx.ledger, ctx.phase = (send_counts, recv_counts), group, ledger, phases[1]
        _count(ledger, phases[0], x, send_counts, group)
        return _move(x, send_counts, recv_counts, group)

    @staticmethod
    def backward(ctx, grad):
        send_counts, recv_counts = ctx.counts
        _count(ctx.ledger, ctx.phase, grad, recv_counts, ctx.group)  # the rows go back where they came from
        return _move(grad, recv_counts, send_counts, ctx.group), None, None, None, None, None


def all_to_all(
    x: torch.Tensor,
    send_counts: Sequence[int],
    recv_counts: Sequence[int],
    group=None,
    ledger: Ledger | None = None,
    phases: tuple[str, str] = ("forward", "backward"),
) -> torch.Tensor:
    """The differentiable all-to-all over `group` (None: the world): rows send_counts[q] of x to rank q,
    recv_counts[s] rows from rank s; bytes sent counted in `ledger` under phases (forward, backward)."""
    send_counts, recv_counts = [int(c) for c in send_counts], [int(c) for c in recv_counts]
    world = dist.get_world_size(group)
    if len(send_counts) != world or len(recv_counts) != world or min(send_counts + recv_counts) < 0:
        raise ValueError(f"all_to_all: counts {send_counts}, {recv_counts} are not P = {world} counts >= 0 each")
    if sum(send_counts) != len(x):
        raise ValueError(f"all_to_all: send_counts {send_counts} add up to {sum(send_counts)} rows, x has {len(x)}")
    return AllToAll.apply(x, send_counts, recv_counts, group, ledger, phases)
