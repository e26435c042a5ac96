"""Peak memory of a block of code, on any device: the bytes of tensor storage it creates and keeps alive.

`torch.cuda.max_memory_allocated` answers this on GPUs only. `PeakMemory` answers it everywhere by
watching every op through a `TorchDispatchMode`: each new output storage adds its bytes to a running
total, and a `weakref.finalize` on the storage takes them off again when the storage is freed. The
peak of that total is the block's extra memory: what it allocated on top of what existed before
(parameters, inputs, anything created outside the block are not counted). `largest` is the biggest
single storage it made, the "largest temporary" a lesson reports against N x N.

It counts tensor storage only, not allocator slack or Python objects; on CPU that is the honest
figure to compare between methods, since the allocator's caching would blur an RSS reading.

On a GPU the two can be set side by side: `PeakMemory(device)` with a CUDA device also reads
`torch.cuda.max_memory_allocated` over the block (the device synchronized at both ends, its peak
counter reset at the start) into `allocator_peak_bytes`, above what was allocated before. The allocator
rounds every block up to a multiple of 512 bytes and also counts what torch
allocates outside any op it dispatches (a collective's buffers, cuBLAS's workspace), so its figure is at
least PeakMemory's; a gap much larger than that rounding is memory PeakMemory did not see.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

MIB = 2**20  # bytes in a mebibyte, the unit every memory figure is printed in


class PeakMemory(TorchDispatchMode):
    """with PeakMemory() as mem: ...;  mem.peak_bytes, mem.largest_bytes, mem.live_bytes (and with a CUDA
    `device`, mem.allocator_peak_bytes: the CUDA allocator's peak over the block, else None)"""

    def __init__(self, device: torch.device | None = None) -> None:
        super().__init__()
        self.live_bytes = 0
        self.peak_bytes = 0
        self.largest_bytes = 0
        self._seen: set[int] = set()
        self.cuda = device if device is not None and device.type == "cuda" else None
        self.allocator_peak_bytes: int | None = None
        self._allocated_before = 0

    def __enter__(self):
        if self.cuda is not None:
            torch.cuda.synchronize(self.cuda)
            self._allocated_before = torch.cuda.memory_allocated(self.cuda)
            torch.cuda.reset_peak_memory_stats(self.cuda)
        return super().__enter__()

    def __exit__(self, *exc):
        if self.cuda is not None:
            torch.cuda.synchronize(self.cuda)
            self.allocator_peak_bytes = torch.cuda.max_memory_allocated(self.cuda) - self._allocated_before
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # An output that shares an input's storage (a view, an in-place op) allocated nothing.
        inputs = {
            t.untyped_storage()._cdata
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor) and t.device.type != "meta"
        }
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                if storage._cdata not in inputs:
                    self._track(storage)
        return out

    def _track(self, storage: torch.UntypedStorage) -> None:
        key = storage._cdata  # one per underlying storage: views and in-place results share it
        if key in self._seen or storage.nbytes() == 0:
            return
        nbytes = storage.nbytes()
        self._seen.add(key)
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        self.largest_bytes = max(self.largest_bytes, nbytes)
        weakref.finalize(storage, self._release, key, nbytes)

    def _release(self, key: int, nbytes: int) -> None:
        self._seen.discard(key)
        self.live_bytes -= nbytes
