"""What the exercises' judge sees beyond numbers: every allocation's shape, how many tensors of a kind are
alive at once, and every collective, on one rank.

`Watch` is a `TorchDispatchMode`, like `distlab.proof.memory.PeakMemory`: every op of the answer (its backward
too: autograd runs a CPU graph on the calling thread, under the same mode) passes through it. For each new
storage it records the shape (so "nothing N x N, C x N or B x N" is a question about `shapes`), and, when
`kind(shape)` names the tensor ("k/v block", "C x d block"), counts it alive until its storage is freed
(a `weakref.finalize`): `peak[kind]` is the most of that kind this rank held at once, the per-rank memory
a lesson bounds. Collectives reach the dispatcher as `c10d` ops: `collectives` lists each call's kind and
the bytes of its whole tensor, and `sent` prices them by the ring formulas, so a check counts all-reduces
and bytes without trusting what the answer says it sent. An all-to-all (torch's `all_to_all_single`, or
the functional one with autograd, forward and backward) is recorded with the bytes it sends exactly: its
input but the part for this rank itself, whatever the splits.

DDP's own all-reduce runs inside its reducer, where no mode sees it: the checks count it with a DDP comm
hook (`distlab.data_split.data_parallel.ddp.counting`).
"""

from __future__ import annotations

import weakref
from collections import Counter
from collections.abc import Callable
from fractions import Fraction

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from distlab.comm.collectives import ring_fraction

KINDS = {  # c10d's ops, by the collective they are
    "allreduce_": "all_reduce",
    "allgather_": "all_gather",
    "_allgather_base_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "reduce_scatter_": "reduce_scatter",
    "_reduce_scatter_base_": "reduce_scatter",
    "broadcast_": "broadcast",
    "recv_": "recv",
    "alltoall_base_": "all_to_all",
}


class Watch(TorchDispatchMode):
    """with Watch(kind) as w: ...;  w.shapes, w.peak[kind], w.calls(), w.sent(P)"""

    def __init__(self, kind: Callable[[tuple], str | None] = lambda shape: None) -> None:
        super().__init__()
        self.kind = kind
        self.shapes: set[tuple] = set()
        self.live: Counter = Counter()
        self.peak: Counter = Counter()
        self.collectives: list[tuple[str, int]] = []  # (kind, bytes of the whole tensor; all_to_all: sent)
        self._seen: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.namespace == "c10d":
            self._collective(func.__name__.split(".")[0], args)
            return out
        if func.namespace == "_c10d_functional" and func.__name__.startswith("all_to_all_single"):
            group = _resolve_process_group(args[3])  # (input, output splits, input splits, group name)
            self.collectives.append(("all_to_all", _part_sent(args[0], args[2], group)))
            return out
        inputs = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in inputs:
                self._track(t)
        return out

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        if storage._cdata in self._seen or storage.nbytes() == 0:
            return
        self._seen.add(storage._cdata)
        self.shapes.add(tuple(t.shape))
        kind = self.kind(tuple(t.shape))
        if kind is not None:
            self.live[kind] += 1
            self.peak[kind] = max(self.peak[kind], self.live[kind])
        weakref.finalize(storage, self._release, storage._cdata, kind)

    def _release(self, key: int, kind: str | None) -> None:
        self._seen.discard(key)
        if kind is not None:
            self.live[kind] -= 1

    def _collective(self, op: str, args: tuple) -> None:
        kind = KINDS.get(op, op)
        if kind == "all_to_all":  # (output, input, group, output splits, input splits, ...)
            self.collectives.append((kind, _part_sent(args[1], args[4], dist.ProcessGroup.unbox(args[2]))))
            return
        # the whole tensor of the ring formulas: the all-gather's output, the reduce-scatter's input
        whole = args[1] if kind == "reduce_scatter" else args[0]
        tensors = [t for t in tree_leaves(whole) if isinstance(t, torch.Tensor)]
        self.collectives.append((kind, sum(t.numel() * t.element_size() for t in tensors)))

    def calls(self) -> Counter:
        """How many times each collective ran, by kind ("all_reduce", "all_gather", "send", ...)."""
        return Counter(kind for kind, _ in self.collectives)

    def sent(self, world: int) -> float:
        """Bytes this rank sends in the collectives it ran, by the ring formulas (`distlab.comm`'s
        `ring_fraction`: all-reduce 2 (P-1)/P of the tensor, all-gather and reduce-scatter (P-1)/P of the
        whole), plus every send."""
        fraction = {
            **{
                kind: lambda p, kind=kind: ring_fraction(kind, p)
                for kind in ("all_reduce", "all_gather", "reduce_scatter")
            },
            "send": lambda p: 1,
            "all_to_all": lambda p: 1,  # recorded as the bytes it sends
            "recv": lambda p: 0,
            "broadcast": lambda p: Fraction(p - 1, p),
        }
        return float(sum(fraction[kind](world) * nbytes for kind, nbytes in self.collectives))


def _part_sent(x: torch.Tensor, splits: list[int] | None, group) -> int:
    """Bytes an all-to-all of x's rows over `group` sends: every row but those of this rank's own part
    (no splits: P equal parts)."""
    row = x[0].numel() * x.element_size() if len(x) else 0
    own = splits[group.rank()] if splits else len(x) // group.size()
    return (len(x) - own) * row


def spanning(shapes: set[tuple], long: int, across: set[int]) -> list[tuple]:
    """The shapes with `long` in one dimension and one of `across` in another: the forbidden temporaries
    (N x N, C x N, B x N for long = N, across = {N, C, B})."""
    found = []
    for shape in shapes:
        for i, size in enumerate(shape):
            if size == long and any(other in across for j, other in enumerate(shape) if j != i):
                found.append(shape)
                break
    return sorted(found)
