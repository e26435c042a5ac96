"""Counting what a block of code launches, without running it on a GPU: torch ops that start a kernel, and
the streamed step's Triton launches, each with the bytes of the tensors it reads and writes.

`LaunchCount` watches every torch op through a `TorchDispatchMode` (on any device, the meta device
included, where nothing is computed): an op counts as a launch unless it only makes a view or an empty
tensor, and its bytes are its tensor inputs' plus its outputs' (an in-place op reads and writes its
tensor: twice). The Triton kernels of `distlab.streamed.kernels` report each launch here, with the bytes of
the tensors it reads and writes once, and on the meta device do nothing else: so one rank's whole step can be
counted at N = 65,536 on a laptop (count, don't compute). Bytes are a floor: what the launch cannot avoid
moving between memory and the chip (a tiled matmul re-reads its operands from the cache; see
`distlab.streamed.kernels` for the kernels' own re-reads).
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

NO_KERNEL = {
    "empty",
    "empty_like",
    "empty_strided",
    "new_empty",
    "new_empty_strided",
    "detach",
    "lift_fresh",
    "alias",
    "_local_scalar_dense",
    "set_",
    "_to_copy_meta",
}
_active: list[LaunchCount] = []


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


class LaunchCount(TorchDispatchMode):
    """with LaunchCount() as count: ...;  count.launches, count.moved_bytes, count.by_name (launches per op)."""

    def __init__(self) -> None:
        super().__init__()
        self.launches = 0
        self.moved_bytes = 0
        self.by_name: Counter = Counter()

    def add(self, name: str, moved_bytes: int) -> None:
        self.launches += 1
        self.moved_bytes += moved_bytes
        self.by_name[name] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func._schema.name.split("::")[1]
        if not (func.is_view or name in NO_KERNEL):
            self.add(name, _bytes(tree_leaves((args, kwargs))) + _bytes(tree_leaves(out)))
        return out

    def __enter__(self):
        _active.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        _active.remove(self)
        return super().__exit__(*exc)


def record_kernel(name: str, moved_bytes: int) -> None:
    """A Triton launch (called by `distlab.streamed.kernels` for each one), counted by every open `LaunchCount`."""
    for count in _active:
        count.add(name, moved_bytes)
