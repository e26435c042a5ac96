"""What a pipeline stage holds for backward, and how much forward work it does: measured, not derived.

Saved activations. Autograd keeps, from every forward, the tensors its backward will need (a
Linear keeps its input, a Tanh its output). `torch.autograd.graph.saved_tensors_hooks` hands each
of them to a "pack" hook as it is saved; the probe adds up their bytes per forward (one stage, one
micro-batch), skipping parameters (they exist anyway) and counting a tensor saved twice (Tanh's
output is also the next Linear's input) once. A forward's saved tensors are freed when its backward
has run (the weight gradient's, when the backward is split), so a rank holds, at any moment, the sum
over the forwards in flight; the probe tracks the peak.

Checkpointing changes what is saved. `checkpoint(f, x, use_reentrant=False)` saves only x (through
our hook, so it is counted) and keeps nothing from inside f, which it reruns during backward.
(The rerun's transient activations live only while that one segment's backward runs; they are
not part of what the stage holds across the schedule, and the probe does not count them.)

Forward work. A forward hook on each layer counts its calls; the recomputation inside a checkpointed
segment calls the layers again, so the count shows exactly the extra forward compute.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from contextlib import contextmanager

import torch
from torch import nn


class StageProbe:
    """probe = StageProbe(modules); with probe.forward(key): ...; probe.release(key) once the
    backward that frees them has run. A key names one forward: (stage, micro-batch)."""

    def __init__(self, modules: list[nn.Module]):
        self._parameter_storages = {p.untyped_storage().data_ptr() for m in modules for p in m.parameters()}
        self.held: dict[Hashable, int] = {}  # key -> bytes saved for its backward
        self.live_bytes = 0
        self.peak_bytes = 0
        self.layer_forwards = 0
        self._handles = [layer.register_forward_hook(self._count) for m in modules for layer in m.children()]

    def _count(self, *_: object) -> None:
        self.layer_forwards += 1

    @contextmanager
    def forward(self, key: Hashable) -> Iterator[None]:
        """Count the bytes autograd saves while this block runs the forward named `key`."""
        seen: set[tuple] = set()
        self.held.setdefault(key, 0)

        def pack(t: torch.Tensor) -> torch.Tensor:
            view = (t.data_ptr(), tuple(t.shape), tuple(t.stride()))
            if t.untyped_storage().data_ptr() not in self._parameter_storages and view not in seen:
                seen.add(view)
                nbytes = t.numel() * t.element_size()
                self.held[key] += nbytes
                self.live_bytes += nbytes
                self.peak_bytes = max(self.peak_bytes, self.live_bytes)
            return t  # keep the tensor itself: we only watch

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield

    def release(self, key: Hashable) -> None:
        """The backward of `key` has run: autograd has freed what it saved."""
        self.live_bytes -= self.held[key]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
