"""What the four collectives compute, what a ring algorithm sends for each, and how long torch's take.

Rank r holds x_r. "bytes" is the size of the *full* tensor: the reduced one (all_reduce,
reduce_scatter's input), the gathered one (all_gather's output), the broadcast one.

| collective     | rank r holds before | rank r holds after            | a ring sends per rank  |
|----------------|---------------------|-------------------------------|------------------------|
| all_reduce     | x_r (bytes)         | sum_q x_q                     | 2 (P-1)/P * bytes      |
| all_gather     | x_r (bytes / P)     | cat(x_0, ..., x_{P-1})        | (P-1)/P * bytes        |
| reduce_scatter | x_r (bytes)         | chunk r of sum_q x_q (1/P)    | (P-1)/P * bytes        |
| broadcast      | x_0 on rank 0       | x_0                           | bytes (all but last)   |

A ring all-reduce is a reduce-scatter followed by an all-gather, hence twice the traffic: each rank
sends P-1 chunks of bytes/P in each half (`distlab.data_parallel.ring` runs them, counting bytes).
A pipelined chain broadcast has every rank but the last forward the whole tensor once. Divided by
the time, these byte counts are what nccl-tests calls the bus bandwidth
(https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md): if the ring formula
describes the cost, the four collectives show about the same bus bandwidth.

`Collective.expected` is the single-process computation of the same thing, from every rank's input;
`rank_input` builds rank q's input from the seed alone, so every rank can rebuild all P inputs and
check its own result without any further communication.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from distlab import compat
from distlab.runtime import Runtime

Tensor = torch.Tensor


@dataclass(frozen=True)
class Collective:
    name: str
    input_is_chunk: bool  # rank input: one P-th of the full tensor, else all of it
    run: Callable[[Tensor, int], Tensor]  # torch's collective on this rank's input (P given)
    expected: Callable[[list[Tensor], int], Tensor]  # every rank's input, rank r -> rank r's result
    ring_fraction: Callable[[int, int], float]  # (P, rank) -> what the ring has that rank send / bytes
    formula: str


def _all_reduce(x: Tensor, p: int) -> Tensor:
    out = x.clone()
    dist.all_reduce(out)  # sum, in place
    return out


def _all_gather(x: Tensor, p: int) -> Tensor:
    out = x.new_empty(p * x.numel())
    compat.all_gather_single(out, x)
    return out


def _reduce_scatter(x: Tensor, p: int) -> Tensor:
    out = x.new_empty(x.numel() // p)
    compat.reduce_scatter_single(out, x)
    return out


def _broadcast(x: Tensor, p: int) -> Tensor:
    out = x.clone()
    dist.broadcast(out, src=0)
    return out


ALL_REDUCE = Collective(
    "all_reduce",
    False,
    _all_reduce,
    lambda xs, r: torch.stack(xs).sum(0),
    lambda p, r: 2 * (p - 1) / p,
    "2(P-1)/P x bytes",
)
ALL_GATHER = Collective(
    "all_gather", True, _all_gather, lambda xs, r: torch.cat(xs), lambda p, r: (p - 1) / p, "(P-1)/P x bytes"
)
REDUCE_SCATTER = Collective(
    "reduce_scatter",
    False,
    _reduce_scatter,
    lambda xs, r: torch.stack(xs).sum(0).chunk(len(xs))[r],
    lambda p, r: (p - 1) / p,
    "(P-1)/P x bytes",
)
BROADCAST = Collective(
    "broadcast", False, _broadcast, lambda xs, r: xs[0], lambda p, r: 1.0 if r < p - 1 else 0.0, "1 x bytes"
)
COLLECTIVES = (ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, BROADCAST)


def full_numel(nbytes: int, p: int, dtype: torch.dtype) -> int:
    """Elements of the full tensor: `nbytes` worth, rounded down to a multiple of P (at least P)."""
    per = torch.tensor([], dtype=dtype).element_size()
    return max(p, nbytes // per // p * p)


def input_numel(c: Collective, n: int, p: int) -> int:
    """Elements of one rank's input: all_gather's input is one rank's chunk, the others the whole."""
    return n // p if c.input_is_chunk else n


def rank_input(c: Collective, n: int, rank: int, rt: Runtime, seed: int, dtype: torch.dtype) -> Tensor:
    """Rank `rank`'s input, from the seed alone (the same tensor whichever rank builds it)."""
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    return torch.randn(input_numel(c, n, rt.world_size), generator=gen, dtype=dtype).to(rt.device)


def check_collective(c: Collective, rt: Runtime, n: int, seed: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(torch's result on this rank, the single-process result for this rank)."""
    got = c.run(rank_input(c, n, rt.rank, rt, seed, dtype), rt.world_size)
    every = [rank_input(c, n, q, rt, seed, dtype).cpu() for q in range(rt.world_size)]
    return got, c.expected(every, rt.rank)


def barrier(rt: Runtime) -> None:
    """Every rank here before anyone goes on: a one-element all-reduce on the group's device."""
    dist.all_reduce(torch.zeros(1, device=rt.device))
    if rt.device.type == "cuda":
        torch.cuda.synchronize(rt.device)


def slowest_median(rt: Runtime, seconds: list[float]) -> float:
    """Per repetition the slowest rank's time (a collective ends when its last rank is done);
    the median over the repetitions."""
    times = torch.tensor(seconds, dtype=torch.float64, device=rt.device)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return statistics.median(times.tolist())


def time_call(rt: Runtime, fn: Callable[[], object], repeats: int) -> float:
    """Median seconds of `fn()` over `repeats` runs (slowest rank each), after one warm-up run."""
    fn()
    seconds = []
    for _ in range(repeats):
        barrier(rt)
        start = time.perf_counter()
        fn()
        if rt.device.type == "cuda":
            torch.cuda.synchronize(rt.device)
        seconds.append(time.perf_counter() - start)
    return slowest_median(rt, seconds)
