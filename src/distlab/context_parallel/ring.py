"""The ring exchange of context parallelism: pass tensors to the right neighbour, receive the left one's.

Rank r sends to r+1 and receives from r-1 (mod P), every rank at once, so each link carries one block
per step. `post` hands the sends and receives to the backend (one `batch_isend_irecv`) and returns at
once with the buffers the incoming tensors will land in; the caller computes on the block it already
holds and only then `wait`s: the transfer of the next block runs while this one is used.

`bytes_sent` counts what this rank handed to isend, the measured side of the byte formulas.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from distlab.runtime import Runtime


@dataclass
class InFlight:
    """Tensors on their way in: valid after `wait()`."""

    received: list[torch.Tensor]
    works: list

    def wait(self) -> list[torch.Tensor]:
        for work in self.works:
            work.wait()
        self.works = []  # a send's Work keeps its tensor alive: let the block we sent go
        return self.received


class RingExchange:
    def __init__(self, rt: Runtime):
        self.rt = rt
        self.bytes_sent = 0

    def post(self, *tensors: torch.Tensor) -> InFlight:
        """Start sending `tensors` right and receiving as many of the same shapes from the left.
        One rank alone is its own neighbour: the tensors come back as they are, nothing is sent."""
        if self.rt.world_size == 1:
            return InFlight(list(tensors), [])
        right = (self.rt.rank + 1) % self.rt.world_size
        left = (self.rt.rank - 1) % self.rt.world_size
        received = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t, right) for t in tensors]
        ops += [dist.P2POp(dist.irecv, buf, left) for buf in received]
        self.bytes_sent += sum(t.numel() * t.element_size() for t in tensors)
        return InFlight(received, dist.batch_isend_irecv(ops))
