"""The collectives by hand, with point-to-point messages, counting the bytes each rank sends.

The P ranks of a group stand in a ring; each sends only to its right neighbour (r+1) and receives only
from its left one (r-1), all at once, so every link carries data in every step and no rank is a hot
spot. The full tensor (`bytes` in size) is cut into P chunks of bytes/P.

- shift: one step of the ring, the tensors this rank holds go right and as many arrive from the left;
  posted, so the caller computes on what it holds while they travel (ring attention, lesson 09).
- reduce-scatter, P-1 steps: in step k rank r passes its partial sum of chunk (r-k-1) to the right
  and adds the partial sum of chunk (r-k-2) it receives from the left. After P-1 steps chunk r holds
  every rank's contribution: rank r owns sum_q x_q[chunk r]. Sent: (P-1) * bytes/P.
- all-gather, P-1 steps: in step k rank r passes chunk (r-k) on and receives chunk (r-k-1), which
  its left neighbour received one step earlier. Sent: (P-1) * bytes/P.
- all-reduce = reduce-scatter, then all-gather of the reduced chunks. Sent: 2 (P-1)/P * bytes.
- broadcast, a pipelined chain 0 -> 1 -> ... -> P-1: each rank forwards each piece as soon as it
  has it. Sent: bytes, by every rank but the last.
- all-to-all, P-1 rounds: in round k rank r sends its part for rank r+k and receives rank r-k's part
  for it (each round a shift by k around the ring: every rank sends one part and receives one, so no
  rank waits on another's order); its own part it keeps. With parts of any sizes (`send_counts`,
  `recv_counts`, rows along dim 0, as `dist.all_to_all_single` takes them). Sent: what it addresses
  to the others, (P-1)/P * bytes for equal parts.

Every message goes through `distlab.comm.p2p.post`, which counts it in `ledger`: the measured side of
the formulas in `distlab.comm.collectives`. These are for reading and counting; NCCL and gloo run
tuned versions of the same ideas (and gloo picks its own algorithm per collective and size).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from distlab.comm.collectives import ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, BROADCAST, REDUCE_SCATTER
from distlab.comm.ledger import Ledger
from distlab.comm.p2p import Posted, post

BROADCAST_PIECES = 8


class Ring:
    """This rank's place in a ring over `group` (None: the world), counting what it sends in `ledger`."""

    def __init__(self, group=None, ledger: Ledger | None = None):
        self.group = group
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.right, self.left = (self.rank + 1) % self.world_size, (self.rank - 1) % self.world_size
        self.ledger = ledger if ledger is not None else Ledger()

    def shift(self, *tensors: torch.Tensor, tag: int = 0) -> Posted:
        """Start sending `tensors` right and receiving as many of the same shapes from the left; `wait()`
        returns the received ones. One rank alone is its own neighbour: the tensors come back as they
        are (nothing allocated, nothing sent)."""
        if self.world_size == 1:
            return Posted(list(tensors))
        tensors = tuple(t.contiguous() for t in tensors)
        received = [torch.empty_like(t) for t in tensors]
        sends = [(t, self.right) for t in tensors]
        return post(sends, [(buf, self.left) for buf in received], self.group, self.ledger, tag)

    def _step(self, send: torch.Tensor, into: torch.Tensor) -> None:
        """One ring step into a buffer of the caller's: send right, receive from the left, wait."""
        post([(send, self.right)], [(into, self.left)], self.group, self.ledger).wait()

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        r, p = self.rank, self.world_size
        # views into one copy: partial sums accumulate in place
        chunks = x.clone(memory_format=torch.contiguous_format).chunk(p)
        incoming = torch.empty_like(chunks[0])
        for k in range(p - 1):
            self._step(chunks[(r - k - 1) % p], incoming)
            chunks[(r - k - 2) % p].add_(incoming)
        return chunks[r].clone()

    def all_gather(self, mine: torch.Tensor) -> torch.Tensor:
        r, p = self.rank, self.world_size
        out = mine.new_empty(p * mine.numel())
        chunks = out.chunk(p)
        chunks[r].copy_(mine)
        for k in range(p - 1):
            self._step(chunks[(r - k) % p], chunks[(r - k - 1) % p])
        return out

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return self.all_gather(self.reduce_scatter(x))

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's x on every rank, down the chain 0 -> 1 -> ... -> P-1, piece by piece."""
        r, p = self.rank, self.world_size
        out = x.clone(memory_format=torch.contiguous_format)  # pieces land in place: contiguous
        forwarded = []
        for piece in out.chunk(BROADCAST_PIECES):
            if r > 0:
                post([], [(piece, r - 1)], self.group, self.ledger).wait()
            if r < p - 1:  # on its way while the next piece arrives
                forwarded.append(post([(piece, r + 1)], [], self.group, self.ledger))
        for posted in forwarded:
            posted.wait()
        return out

    def all_to_all(
        self, x: torch.Tensor, send_counts: Sequence[int] | None = None, recv_counts: Sequence[int] | None = None
    ) -> torch.Tensor:
        """Rows send_counts[q] of x (in order) to rank q; rows recv_counts[q] of the result from rank q.
        Equal parts when the counts are not given (then P must divide len(x))."""
        r, p = self.rank, self.world_size
        send_counts = _parts(send_counts, len(x), p, "send_counts")
        recv_counts = _parts(recv_counts, len(x), p, "recv_counts")
        if sum(send_counts) != len(x):
            raise ValueError(f"send_counts: {send_counts} add up to {sum(send_counts)} rows, x has {len(x)}")
        parts = x.split(list(send_counts))
        out = x.new_empty((sum(recv_counts), *x.shape[1:]))
        landing = out.split(list(recv_counts))
        landing[r].copy_(parts[r])  # my own part stays
        for k in range(1, p):
            to, source = (r + k) % p, (r - k) % p
            sends = [(parts[to], to)] if send_counts[to] else []  # an empty part is no message, both
            receives = [(landing[source], source)] if recv_counts[source] else []  # sides know its size
            post(sends, receives, self.group, self.ledger).wait()
        return out


def _parts(counts: Sequence[int] | None, rows: int, world: int, name: str) -> list[int]:
    """The parts' sizes: as given (P non-negative counts), or `rows` cut into P equal parts."""
    if counts is None:
        if rows % world:
            raise ValueError(f"{name}: {rows} rows do not cut into P = {world} equal parts; give the counts")
        return [rows // world] * world
    counts = list(counts)
    if len(counts) != world or any(c < 0 for c in counts):
        raise ValueError(f"{name}: {counts} is not P = {world} non-negative counts")
    return counts


# The ring version of each collective (the same inputs and results as torch's).
RING_RUNS = {
    ALL_REDUCE: Ring.all_reduce,
    ALL_GATHER: Ring.all_gather,
    REDUCE_SCATTER: Ring.reduce_scatter,
    BROADCAST: Ring.broadcast,
    ALL_TO_ALL: Ring.all_to_all,
}
