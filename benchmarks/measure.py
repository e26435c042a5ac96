"""What the contrastive benchmarks share: their embeddings, and how they measure a call on every rank.

`measure_interleaved(calls, rt, repeats)`: each call's memory, in a run of its own, then its median time,
the calls taking turns (a burst of load on a shared machine hits them alike).

Memory is the peak of tensor storage a call allocated (`distlab.proof.memory.PeakMemory`, on any device;
plus `torch.cuda.max_memory_allocated` on GPUs), the worst rank's; time is the wall clock of the
slowest rank (a step is as slow as its slowest rank).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from distlab.proof.memory import PeakMemory


def local_embeddings(n: int, d: int, rt, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's C rows of unit-norm N x d embeddings, positives correlated (rows seeded per rank)."""
    gen = torch.Generator().manual_seed(1000 * n + rt.rank)
    z_x = F.normalize(torch.randn(n // rt.world_size, d, generator=gen, dtype=dtype), dim=1)
    z_y = F.normalize(z_x + torch.randn(n // rt.world_size, d, generator=gen, dtype=dtype), dim=1)
    return z_x.to(rt.device), z_y.to(rt.device)


def worst_rank(values: list[float], rt) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=rt.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def measure_memory(fn, rt) -> dict:
    if rt.device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    with PeakMemory() as mem:
        fn()
    values = [mem.peak_bytes, mem.largest_bytes]
    if rt.device.type == "cuda":
        values.append(torch.cuda.max_memory_allocated() - base)
    values = worst_rank(values, rt)
    out = {"peak_bytes": int(values[0]), "largest_bytes": int(values[1])}
    if len(values) > 2:
        out["cuda_peak_bytes"] = int(values[2])
    return out


def measure_time(fn, rt) -> float:
    dist.barrier()
    if rt.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if rt.device.type == "cuda":
        torch.cuda.synchronize()
    return worst_rank([time.perf_counter() - start], rt)[0]


def measure_interleaved(calls: dict, rt, repeats: int) -> dict[str, dict]:
    """Per call: its memory (`measure_memory`), its median time and every time (`measure_time`)."""
    mems = {m: measure_memory(fn, rt) for m, fn in calls.items()}
    times = {m: [] for m in calls}
    for _ in range(repeats):
        for m, fn in calls.items():  # interleaved: a burst of load hits every method
            times[m].append(measure_time(fn, rt))
    return {m: {**mems[m], "time_s": statistics.median(times[m]), "times_s": times[m]} for m in calls}
