"""What autograd saves on a rank of the mesh, and the most of it alive at once: the activations' side of
lesson 12's memory per rank.

The ground floor's rule (`distlab.proof.held`): a saved tensor counts the bytes of its storage, each storage once.
Two things are new on the mesh. A DTensor is a wrapper: its bytes are its local tensor's, so the counter
unwraps it. And the parameters autograd saves (a Linear keeps its weight, or a view of it, for the input's
gradient) are not activations: under FSDP2 they are the gathered copies the unit holds anyway, so a saved
tensor that is a parameter, or a view of one, is left out.

`SavedLive` watches a whole pipeline step: each storage saved is live from the moment it is saved until it
is freed (a `weakref.finalize` on the storage, as `distlab.proof.memory.PeakMemory` does), so `peak_bytes` is the
most this rank kept for backward at once: under 1F1B, min(M, pp - p) micro-batches on stage p (lesson 03),
each holding what `first_bytes` counts for the first one.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.distributed.tensor import DTensor


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def is_parameter(t: torch.Tensor) -> bool:
    """A parameter, or a view of one (a Linear saves its weight's transpose), DTensor or not."""
    return isinstance(t, nn.Parameter) or isinstance(getattr(t, "_base", None), nn.Parameter)


class SavedLive:
    """with SavedLive() as saved: step(); then saved.peak_bytes, and saved.first_bytes: the bytes saved
    up to the first `mark()` (the first micro-batch's forward and loss, when the caller marks its end)."""

    def __init__(self) -> None:
        self.live: dict[int, int] = {}
        self.live_bytes = self.peak_bytes = 0
        self.first_bytes: int | None = None

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if not is_parameter(t):
            storage = _local(t).untyped_storage()
            key = storage.data_ptr()
            if key not in self.live and storage.nbytes():
                self.live[key] = storage.nbytes()
                self.live_bytes += storage.nbytes()
                self.peak_bytes = max(self.peak_bytes, self.live_bytes)
                weakref.finalize(storage, self._free, key)
        return t

    def _free(self, key: int) -> None:
        self.live_bytes -= self.live.pop(key, 0)

    def mark(self) -> None:
        """The end of the first micro-batch's forward: what is live now is what it saved."""
        if self.first_bytes is None:
            self.first_bytes = self.live_bytes

    def __enter__(self) -> SavedLive:
        self._hooks = saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
