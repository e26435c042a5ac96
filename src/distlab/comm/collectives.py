"""The collectives: what each computes, and what a ring algorithm sends for it, as exact fractions.

Rank r holds x_r. "bytes" is the size of the *full* tensor: the reduced one (all_reduce,
reduce_scatter's input), the gathered one (all_gather's output), the broadcast one, and for
all_to_all one rank's input (P equal parts, part q for rank q).

| collective     | rank r holds before | rank r holds after              | a ring sends per rank  |
|----------------|---------------------|---------------------------------|------------------------|
| all_reduce     | x_r (bytes)         | sum_q x_q                       | 2 (P-1)/P * bytes      |
| all_gather     | x_r (bytes / P)     | cat(x_0, ..., x_{P-1})          | (P-1)/P * bytes        |
| reduce_scatter | x_r (bytes)         | chunk r of sum_q x_q (1/P)      | (P-1)/P * bytes        |
| broadcast      | x_0 on rank 0       | x_0                             | bytes (all but last)   |
| all_to_all     | x_r (bytes)         | cat(part r of x_0, ..., x_{P-1})| (P-1)/P * bytes        |

A ring all-reduce is a reduce-scatter followed by an all-gather, hence twice the traffic: each rank
sends P-1 chunks of bytes/P in each half (`distlab.comm.ring` runs them by hand, counting bytes). A
pipelined chain broadcast has every rank but the last forward the whole tensor once. An all-to-all
keeps its own part and sends each of the P-1 others theirs; with uneven parts (`all_to_all_bytes`) a
rank sends the rows it addresses to the others. Divided by the time, these byte counts are what
nccl-tests calls the bus bandwidth (https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md).

The fractions are `fractions.Fraction`s, so a byte count is an exact integer or an error, never a
rounded float: a ring cuts the tensor into P equal chunks, and a tensor that does not cut evenly has
no ring formula (`ring_bytes` says so). One table serves every package that counts bytes (data,
tensor and sequence parallelism, the contrastive gathers) and the ledger that records them.

`Collective.expected` is the single-process computation of the same thing, from every rank's input;
`rank_input` builds rank q's input from the seed alone, so every rank can rebuild all P inputs and
check its own result without any further communication.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction

import torch
import torch.distributed as dist

from distlab.comm import compat
from distlab.processes.identity import Runtime

Tensor = torch.Tensor


@dataclass(frozen=True)
class Collective:
    name: str
    input_is_chunk: bool  # rank input: one P-th of the full tensor, else all of it
    run: Callable[[Tensor, int], Tensor]  # torch's collective on this rank's input (P given)
    expected: Callable[[list[Tensor], int], Tensor]  # every rank's input, rank r -> rank r's result
    ring_fraction: Callable[[int, int], Fraction]  # (P, rank) -> what a ring has that rank send / bytes
    formula: str


def _all_reduce(x: Tensor, world: int) -> Tensor:
    out = x.clone()
    dist.all_reduce(out)  # sum, in place
    return out


def _all_gather(x: Tensor, world: int) -> Tensor:
    out = x.new_empty(world * x.numel())
    compat.all_gather_single(out, x)
    return out


def _reduce_scatter(x: Tensor, world: int) -> Tensor:
    out = x.new_empty(x.numel() // world)
    compat.reduce_scatter_single(out, x)
    return out


def _broadcast(x: Tensor, world: int) -> Tensor:
    out = x.clone()
    dist.broadcast(out, src=0)
    return out


def _all_to_all(x: Tensor, world: int) -> Tensor:
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x)  # P equal parts: part q goes to rank q
    return out


ALL_REDUCE = Collective(
    "all_reduce",
    False,
    _all_reduce,
    lambda xs, r: torch.stack(xs).sum(0),
    lambda p, r: Fraction(2 * (p - 1), p),
    "2(P-1)/P x bytes",
)
ALL_GATHER = Collective(
    "all_gather",
    True,
    _all_gather,
    lambda xs, r: torch.cat(xs),
    lambda p, r: Fraction(p - 1, p),
    "(P-1)/P x bytes",
)
REDUCE_SCATTER = Collective(
    "reduce_scatter",
    False,
    _reduce_scatter,
    lambda xs, r: torch.stack(xs).sum(0).chunk(len(xs))[r],
    lambda p, r: Fraction(p - 1, p),
    "(P-1)/P x bytes",
)
BROADCAST = Collective(
    "broadcast",
    False,
    _broadcast,
    lambda xs, r: xs[0],
    lambda p, r: Fraction(1 if r < p - 1 else 0),  # a chain: the last rank forwards nothing
    "1 x bytes",
)
ALL_TO_ALL = Collective(
    "all_to_all",
    False,
    _all_to_all,
    lambda xs, r: torch.cat([x.chunk(len(xs))[r] for x in xs]),
    lambda p, r: Fraction(p - 1, p),
    "(P-1)/P x bytes",
)
COLLECTIVES = (ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, BROADCAST, ALL_TO_ALL)
BY_NAME = {c.name: c for c in COLLECTIVES}


def ring_fraction(kind: str, world: int, rank: int = 0) -> Fraction:
    """What a ring has rank `rank` of `world` send for collective `kind`, in units of the full tensor."""
    if kind not in BY_NAME:
        raise ValueError(f"unknown collective {kind!r}: one of {', '.join(BY_NAME)}")
    return BY_NAME[kind].ring_fraction(world, rank)


def ring_bytes(kind: str, numel: int, itemsize: int, world: int, rank: int = 0) -> int:
    """Bytes a ring has rank `rank` send for collective `kind` on a full tensor of `numel` elements of
    `itemsize` bytes, exactly: the ring moves whole elements in P equal chunks."""
    elements = ring_fraction(kind, world, rank) * numel
    if elements.denominator != 1:
        raise ValueError(
            f"{kind} over P = {world} ranks: a ring cuts the tensor into {world} equal chunks, "
            f"and {numel} elements do not cut evenly"
        )
    return int(elements) * itemsize


def all_to_all_bytes(send_counts: Sequence[int], row_bytes: int, rank: int) -> int:
    """Bytes rank `rank` sends in an all_to_all with uneven parts: `send_counts[q]` rows of `row_bytes`
    bytes for rank q, its own part kept."""
    return (sum(send_counts) - send_counts[rank]) * row_bytes


def full_numel(nbytes: int, world: int, dtype: torch.dtype) -> int:
    """Elements of the full tensor: `nbytes` worth, rounded down to a multiple of P (at least P)."""
    per = torch.tensor([], dtype=dtype).element_size()
    return max(world, nbytes // per // world * world)


def input_numel(c: Collective, n: int, world: int) -> int:
    """Elements of one rank's input: all_gather's input is one rank's chunk, the others the whole."""
    return n // world if c.input_is_chunk else n


def rank_input(c: Collective, n: int, rank: int, rt: Runtime, seed: int, dtype: torch.dtype) -> Tensor:
    """Rank `rank`'s input, from the seed alone (the same tensor whichever rank builds it)."""
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    return torch.randn(input_numel(c, n, rt.world_size), generator=gen, dtype=dtype).to(rt.device)


def check_collective(c: Collective, rt: Runtime, n: int, seed: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(torch's result on this rank, the single-process result for this rank)."""
    got = c.run(rank_input(c, n, rt.rank, rt, seed, dtype), rt.world_size)
    every = [rank_input(c, n, q, rt, seed, dtype).cpu() for q in range(rt.world_size)]
    return got, c.expected(every, rt.rank)
