"""Agree across ranks, then raise: every rank raises the same error, or none does.

A collective that only some ranks reach waits for the others until the process group's timeout. So a
check that could fail on one rank only (its batch, its config, its model's output) never raises
there alone: every rank puts its few facts in one row, one all-gather gives every rank the same
table (`rank_table`), and every rank judges that table the same way. A rank that found a problem it
can only describe in words says so with `raise_together`: the messages are exchanged (only when some
rank has one) and every rank raises all of them, naming the ranks.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from distlab.comm import compat


def rank_table(row: Sequence[float], device: torch.device, group=None) -> torch.Tensor:
    """Every rank's `row` (P x len(row), float64, rank-major), gathered on `device` over `group` (the
    world by default; ranks are the group's), read on the CPU."""
    mine = torch.tensor([float(v) for v in row], dtype=torch.float64, device=device)
    table = mine.new_empty(dist.get_world_size(group) * len(row))
    compat.all_gather_single(table, mine, group=group)
    return table.view(dist.get_world_size(group), len(row)).cpu()


def per_rank(values: Sequence[float], fmt: Callable[[float], str] = lambda v: f"{v:g}") -> str:
    """'rank 0: 4, rank 1: 5' (a NaN, a value that rank did not know, reads '?')."""
    return ", ".join(f"rank {r}: {'?' if math.isnan(v) else fmt(v)}" for r, v in enumerate(values))


def message_length(problem: str | None) -> float:
    """What a rank puts in its row to say it found a problem (0: none)."""
    return float(len(problem.encode())) if problem else 0.0


def raise_together(
    problem: str | None,
    device: torch.device,
    error: type = ValueError,
    cause: BaseException | None = None,
    lengths: Sequence[float] | None = None,
    group=None,
) -> None:
    """Every rank calls this with its own problem (or None). If any rank has one, every rank raises
    `error` with one text naming the ranks and their messages; else every rank returns. `lengths`:
    every rank's `message_length`, when a `rank_table` already exchanged them (saves a collective);
    `group`: the process group the ranks are counted in (the world by default)."""
    if lengths is None:
        lengths = rank_table([message_length(problem)], device, group)[:, 0].tolist()
    if not any(lengths):
        return
    width = int(max(lengths))
    mine = torch.zeros(width, dtype=torch.uint8)
    if problem:
        data = problem.encode()
        mine[: len(data)] = torch.tensor(list(data), dtype=torch.uint8)
    mine = mine.to(device)
    every = mine.new_empty(dist.get_world_size(group) * width)
    compat.all_gather_single(every, mine, group=group)
    every = every.view(-1, width).cpu()
    by_text: dict[str, list[int]] = {}
    for r, n in enumerate(lengths):
        if n:
            by_text.setdefault(bytes(every[r, : int(n)].tolist()).decode(), []).append(r)
    if len(by_text) == 1 and len(next(iter(by_text.values()))) == len(lengths):
        raise error(next(iter(by_text))) from cause  # every rank found the same problem
    message = "; ".join(
        f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {text}" for text, rs in by_text.items()
    )
    raise error(message + " (every rank stops here)") from cause
