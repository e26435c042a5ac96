"""What this machine does, measured: the figures a datasheet would give, for the device the lessons run on.

Every figure is taken on the rank's device (`rt.device`: this CPU, or a rank's GPU), on all P ranks at
once, as the step they predict runs: on a CPU the P processes share the machine's cores, so a rank's
matmul rate is what it gets while the others compute too. Each time is the slowest rank's, the median
over repetitions (`distlab.comm.timing.time_call`).

- `matmul_rate`: FLOP/s of torch.mm on the products a step makes (2 m k n FLOPs each), per dtype;
- `copy_bandwidth`: bytes/s of a large copy (it reads and writes every byte: 2 x its size);
- `op_overhead`: seconds per op of a chain of tiny ops, forward and backward: what Python, autograd and
  torch's dispatcher cost per operation, paid by every op whatever its size (on a GPU it hides behind the
  queue of launched kernels; here it does not);
- `link`: a collective's latency per ring step and bandwidth over the first p ranks, fitted to two sizes
  (t = ring steps x latency + bytes sent / bandwidth): torch's all-reduce, all-gather and reduce-scatter on
  the group's backend (gloo here), and the all-reduce of the ring by hand (`distlab.comm.ring`);
- `memory_size`: the bytes of memory the device has (a GPU's, or this machine's RAM);
- `CountOps`: how many ops a step dispatches (a `TorchDispatchMode` that counts and runs them).
"""

from __future__ import annotations

import os
from collections import Counter
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from distlab.comm import compat
from distlab.comm.collectives import ring_bytes
from distlab.comm.ring import Ring
from distlab.comm.timing import time_call
from distlab.processes.identity import Runtime
from distlab.processes.runtime import DEFAULT_TIMEOUT_S
from distlab.proof.hardware import Link

SMALL, LARGE = 16, 1 << 19  # float32 elements per rank in the two all-reduces a link is fitted to


def matmul_rate(rt: Runtime, shapes: list[tuple[int, int, int]], dtype: torch.dtype, repeats: int) -> float:
    """FLOP/s of torch.mm over `shapes` (m, k, n) on the rank's device, every rank at once."""
    pairs = [(_randn((m, k), dtype, rt), _randn((k, n), dtype, rt)) for m, k, n in shapes]
    seconds = time_call(rt, lambda: [a @ b for a, b in pairs], repeats)
    return sum(2 * m * k * n for m, k, n in shapes) / seconds


def copy_bandwidth(rt: Runtime, nbytes: int, repeats: int) -> float:
    """Memory bytes/s: a copy of `nbytes` reads and writes each byte once."""
    source = _randn((nbytes // 4,), torch.float32, rt)
    target = torch.empty_like(source)
    return 2 * nbytes / time_call(rt, lambda: target.copy_(source), repeats)


def op_overhead(rt: Runtime, repeats: int, length: int = 100) -> float:
    """Seconds per op of a chain of tiny ops (one-element tensors), forward and backward: the fixed price
    of an op with autograd, Python and dispatch included, whatever its size; per op `CountOps` counts."""
    x = torch.ones(1, device=rt.device, requires_grad=True)

    def chain():
        y = x
        for _ in range(length):
            y = y * 1.0001
        y.backward()

    with CountOps() as count:
        chain()
    return time_call(rt, chain, repeats) / count.ops


RUNS = {  # (kind, by hand) -> run(x, group) on a rank's full tensor x (all_gather: its chunk)
    ("all_reduce", True): lambda x, group: Ring(group).all_reduce(x),
    ("all_reduce", False): lambda x, group: dist.all_reduce(x, group=group),
    ("all_gather", False): lambda x, group: compat.all_gather_single(
        x.new_empty(x.numel() * dist.get_world_size(group)), x, group=group
    ),
    ("reduce_scatter", False): lambda x, group: compat.reduce_scatter_single(
        x.new_empty(x.numel() // dist.get_world_size(group)), x, group=group
    ),
}
STEPS = {"all_reduce": lambda p: 2 * (p - 1), "all_gather": lambda p: p - 1, "reduce_scatter": lambda p: p - 1}


def link(rt: Runtime, p: int, kind: str, by_hand: bool, repeats: int) -> Link:
    """Latency per ring step and bandwidth of collective `kind` over ranks 0 .. p-1 (every rank calls this:
    making a group is collective; the ranks outside it wait at the barriers)."""
    # The world's timeout (torch would give a subgroup its own default, 30 minutes on gloo)
    timeout = timedelta(seconds=DEFAULT_TIMEOUT_S)
    group, member = dist.new_group(list(range(p)), timeout=timeout), rt.rank < p
    times, sent = [], []
    for per_rank in (SMALL, LARGE):
        full = per_rank * p
        x = _randn((per_rank if kind == "all_gather" else full,), torch.float32, rt)
        run = (lambda x=x: RUNS[kind, by_hand](x, group)) if member else (lambda: None)
        times.append(time_call(rt, run, repeats))
        sent.append(ring_bytes(kind, full, 4, p))
    bandwidth = (sent[1] - sent[0]) / max(times[1] - times[0], 1e-9)
    latency = max(times[0] - sent[0] / bandwidth, 0.0) / STEPS[kind](p)
    how = "ring by hand" if by_hand else rt.backend  # torch's collective on the world's backend: gloo, or nccl
    return Link(f"{how} {kind}, P = {p}", bandwidth, latency, "measured here")


def memory_size(rt: Runtime) -> int:
    """Bytes of memory the rank's device has: its GPU's, or this machine's RAM (which the P ranks share)."""
    if rt.device.type == "cuda":
        return torch.cuda.get_device_properties(rt.device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _randn(shape: tuple[int, ...], dtype: torch.dtype, rt: Runtime) -> torch.Tensor:
    return torch.randn(shape, dtype=dtype, device=rt.device)


class CountOps(TorchDispatchMode):
    """with CountOps() as count: step()  -> count.ops, the aten ops it dispatched, by name in count.by_name."""

    def __init__(self):
        super().__init__()
        self.by_name: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.by_name[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))

    @property
    def ops(self) -> int:
        return sum(self.by_name.values())
