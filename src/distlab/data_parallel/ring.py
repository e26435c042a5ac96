"""The ring algorithms by hand, with send/recv, counting the bytes each rank sends.

The P ranks stand in a ring; each sends only to its right neighbour (r+1) and receives only from its
left one (r-1), all at once, so every link carries data in every step and no rank is a hot spot.
The full tensor (`bytes` in size) is cut into P chunks of bytes/P.

- reduce-scatter, P-1 steps: in step k rank r passes its partial sum of chunk (r-k-1) to the right
  and adds the partial sum of chunk (r-k-2) it receives from the left. After P-1 steps chunk r holds
  every rank's contribution: rank r owns sum_q x_q[chunk r]. Sent: (P-1) * bytes/P.
- all-gather, P-1 steps: in step k rank r passes chunk (r-k) on and receives chunk (r-k-1), which
  its left neighbour received one step earlier. Sent: (P-1) * bytes/P.
- all-reduce = reduce-scatter, then all-gather of the reduced chunks. Sent: 2 (P-1)/P * bytes.
- broadcast, a pipelined chain 0 -> 1 -> ... -> P-1: each rank forwards each piece as soon as it
  has it. Sent: bytes, by every rank but the last.

`bytes_sent` counts what this rank handed to `send`: the measured side of the formulas in
`distlab.data_parallel.collectives`. These are for reading and counting; NCCL and gloo run tuned
versions of the same ideas (and gloo picks its own algorithm per collective and size).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from distlab.data_parallel.collectives import ALL_GATHER, ALL_REDUCE, BROADCAST, REDUCE_SCATTER
from distlab.runtime import Runtime

BROADCAST_PIECES = 8


class Ring:
    def __init__(self, rt: Runtime):
        self.rt = rt
        self.bytes_sent = 0

    def _pass(self, send: torch.Tensor, recv: torch.Tensor) -> None:
        """Send to the right neighbour and receive from the left one, at the same time."""
        r, p = self.rt.rank, self.rt.world_size
        ops = [dist.P2POp(dist.isend, send, (r + 1) % p), dist.P2POp(dist.irecv, recv, (r - 1) % p)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        self.bytes_sent += send.numel() * send.element_size()

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        r, p = self.rt.rank, self.rt.world_size
        chunks = x.clone().chunk(p)  # views into one copy: partial sums accumulate in place
        incoming = torch.empty_like(chunks[0])
        for k in range(p - 1):
            self._pass(chunks[(r - k - 1) % p], incoming)
            chunks[(r - k - 2) % p].add_(incoming)
        return chunks[r].clone()

    def all_gather(self, mine: torch.Tensor) -> torch.Tensor:
        r, p = self.rt.rank, self.rt.world_size
        out = mine.new_empty(p * mine.numel())
        chunks = out.chunk(p)
        chunks[r].copy_(mine)
        for k in range(p - 1):
            self._pass(chunks[(r - k) % p], chunks[(r - k - 1) % p])
        return out

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return self.all_gather(self.reduce_scatter(x))

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        r, p = self.rt.rank, self.rt.world_size
        out = x.clone()
        sends = []
        for piece in out.chunk(BROADCAST_PIECES):
            if r > 0:
                dist.recv(piece, r - 1)
            if r < p - 1:
                sends.append(dist.isend(piece, r + 1))
                self.bytes_sent += piece.numel() * piece.element_size()
        for work in sends:
            work.wait()
        return out


# The ring version of each collective (the same inputs and results as torch's).
RING_RUNS = {
    ALL_REDUCE: Ring.all_reduce,
    ALL_GATHER: Ring.all_gather,
    REDUCE_SCATTER: Ring.reduce_scatter,
    BROADCAST: Ring.broadcast,
}
