"""How long a collective takes: the slowest rank's time, the median over repetitions.

A collective ends when its last rank is done, so each repetition is timed on every rank from a
barrier and the slowest rank's time stands for it (an all-reduce with MAX); the median over the
repetitions shrugs off the one run a busy machine slowed down. On GPUs the clock stops only after a
CUDA synchronize: a kernel launch returns before the kernel has run.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from distlab.processes.identity import Runtime


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
