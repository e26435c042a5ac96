"""What a pipeline stage holds for backward, and how much forward work it does: measured, not derived.

Saved activations. Autograd keeps, from every forward, the tensors its backward will need (a
Linear keeps its input, a Tanh its output). `torch.autograd.graph.saved_tensors_hooks` hands each
of them to a "pack" hook as it is saved; the probe adds up their bytes per micro-batch, skipping
parameters (they exist anyway) and counting a tensor saved twice (Tanh's output is also the next
Linear's input) once. A micro-batch's saved tensors are freed when its backward has run, so the
stage holds, at any moment, the sum over the micro-batches in flight; the probe tracks the peak.

Checkpointing changes what is saved. `checkpoint(f, x, use_reentrant=False)` saves only x (through
our hook, so it is counted) and keeps nothing from inside f, which it reruns during backward.
(The rerun's transient activations live only while that one segment's backward runs; they are
not part of what the stage holds across the schedule, and the probe does not count them.)

Forward work. A forward hook on each layer counts its calls; the recomputation inside a checkpointed
segment calls the layers again, so the count shows exactly the extra forward compute.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn


class StageProbe:
    """probe = StageProbe(stage_module); with probe.forward(i): ...; probe.release(i) after B(i)."""

    def __init__(self, module: nn.Module):
        self._parameter_storages = {p.untyped_storage().data_ptr() for p in module.parameters()}
        self.held: dict[int, int] = {}      # micro-batch -> bytes saved for its backward
        self.live_bytes = 0
        self.peak_bytes = 0
        self.layer_forwards = 0
        self._handles = [layer.register_forward_hook(self._count) for layer in module.children()]

    def _count(self, *_: object) -> None:
        self.layer_forwards += 1

    @contextmanager
    def forward(self, microbatch: int) -> Iterator[None]:
        """Count the bytes autograd saves while this block runs the forward of `microbatch`."""
        seen: set[tuple] = set()
        self.held.setdefault(microbatch, 0)

        def pack(t: torch.Tensor) -> torch.Tensor:
            key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()))
            if t.untyped_storage().data_ptr() not in self._parameter_storages and key not in seen:
                seen.add(key)
                nbytes = t.numel() * t.element_size()
                self.held[microbatch] += nbytes
                self.live_bytes += nbytes
                self.peak_bytes = max(self.peak_bytes, self.live_bytes)
            return t  # keep the tensor itself: we only watch

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield

    def release(self, microbatch: int) -> None:
        """The backward of `microbatch` has run: autograd has freed what it saved."""
        self.live_bytes -= self.held[microbatch]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
