"""What a pipeline stage holds for backward, and how much forward work it does: measured, not derived.

Saved activations. Autograd keeps, from every forward, the tensors its backward will need (a
Linear keeps its input, a Tanh its output). `distlab.proof.held.SavedActivations` counts them per forward
(one stage, one micro-batch) by the library's one rule: by storage, each storage once however many
views of it are saved (Tanh's output is also the next Linear's input: one storage), parameters
excluded (they exist anyway). A forward's saved tensors are freed when its backward has run (the
weight gradient's, when the backward is split), so a rank holds, at any moment, the storages of the
forwards in flight, each counted once even if two forwards saved it; the probe tracks the peak.

Checkpointing changes what is saved. `checkpoint(f, x, use_reentrant=False)` saves only x (through
our hook, so it is counted) and keeps nothing from inside f, which it reruns during backward.
(The rerun's transient activations live only while that one segment's backward runs; they are
not part of what the stage holds across the schedule, and the probe does not count them.)

Forward work. A forward hook on each layer counts its calls; the recomputation inside a checkpointed
segment calls the layers again, so the count shows exactly the extra forward compute.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Iterator
from contextlib import contextmanager

from torch import nn

from distlab.proof.held import SavedActivations


class StageProbe:
    """probe = StageProbe(modules); with probe.forward(key): ...; probe.release(key) once the
    backward that frees them has run. A key names one forward: (stage, micro-batch)."""

    def __init__(self, modules: list[nn.Module]):
        self._parameters = [p for m in modules for p in m.parameters()]
        self.held: dict[Hashable, int] = {}  # key -> bytes saved for its backward
        self._storages: dict[Hashable, dict[int, int]] = {}  # key -> its saved storages and their bytes
        self._holders: Counter[int] = Counter()  # storage -> forwards in flight that saved it
        self.live_bytes = 0
        self.peak_bytes = 0
        self.layer_forwards = 0
        self._handles = [layer.register_forward_hook(self._count) for m in modules for layer in m.children()]

    def _count(self, *_: object) -> None:
        self.layer_forwards += 1

    @contextmanager
    def forward(self, key: Hashable) -> Iterator[None]:
        """Count the bytes autograd saves while this block runs the forward named `key`."""
        with SavedActivations(exclude=self._parameters) as saved:
            yield
        self._storages[key] = saved.storages
        self.held[key] = saved.nbytes
        for storage, nbytes in saved.storages.items():
            self._holders[storage] += 1
            self.live_bytes += nbytes if self._holders[storage] == 1 else 0
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def release(self, key: Hashable) -> None:
        """The backward of `key` has run: autograd has freed what it saved (what no other forward holds)."""
        for storage, nbytes in self._storages.pop(key).items():
            self._holders[storage] -= 1
            self.live_bytes -= nbytes if self._holders[storage] == 0 else 0

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
