"""Point-to-point messages: post every send and receive at once, compute, wait later.

Every exchange in distlab (a pipeline's activations and gradients, the ring algorithms by hand, ring
attention's key/value blocks, the streamed step's ring, open_clip's SigLIP shifts) is this one step:

    posted = post(sends, receives, group)   # hands every message to the backend, returns at once
    ...                                     # compute on what this rank already holds
    received = posted.wait()                # every message done: the receive buffers, filled

Why all at once. With blocking send/recv two ranks that both send first deadlock: gloo's send waits
for the matching receive, NCCL's once its buffers are full. Posted together in one
`dist.batch_isend_irecv` (one NCCL group on GPUs) the messages progress together, and a rank's
sends and receives never wait on each other's order. Why wait later: the transfer runs while the
rank computes, which is how a ring hides its messages behind the math.

Peers are ranks of `group` (None: the world). `dist.P2POp` names a peer by its global rank, so a
group rank q is mapped with `dist.get_global_rank(group, q)` (rank q of a subgroup, say a
tensor-parallel row of a mesh, is some other rank of the world). A message a rank addresses to
itself never touches the network: the k-th send to oneself is copied into the k-th receive buffer
from oneself (so a ring of one rank works unchanged) and is not counted. Every byte that leaves the
rank is counted in `ledger` (`distlab.comm.ledger`) when one is given.

`Posted` is the one waiter: real messages wait on torch's `Work`s; an in-process emulation
(`distlab.streamed.ring_passes.ListRing`) hands it a function that delivers the received tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from distlab.comm.ledger import Ledger

Tensor = torch.Tensor


class Posted:
    """Messages on their way. `wait()` blocks until every send and receive is done and returns the
    received tensors (the same list on every call)."""

    def __init__(self, received: list[Tensor] | Callable[[], list[Tensor]], works: Sequence = ()):
        self._received = received  # the receive buffers, or a function that delivers them
        self._works = list(works)

    def wait(self) -> list[Tensor]:
        for work in self._works:
            work.wait()
        self._works = []  # a finished Work still holds the tensor it sent: let it go now
        if callable(self._received):
            self._received = self._received()
        return self._received


def _global(group, peer: int) -> int:
    return peer if group is None else dist.get_global_rank(group, peer)


def post(
    sends: Sequence[tuple[Tensor, int]],
    receives: Sequence[tuple[Tensor, int]],
    group=None,
    ledger: Ledger | None = None,
    tag: int = 0,
) -> Posted:
    """Start every send (tensor, peer) and every receive (buffer, peer) at once; return at once.

    Peers are ranks of `group` (None: the world). A send goes contiguous (copied first if it is not); a
    receive buffer, contiguous, gets the message of the same shape and dtype its peer sends."""
    me, world = dist.get_rank(group), dist.get_world_size(group)
    sends = [(t.contiguous(), peer) for t, peer in sends]
    for _, peer in list(sends) + list(receives):
        if not 0 <= peer < world:
            raise ValueError(f"peer {peer} is not a rank of a group of {world}")
    to_self = [t for t, peer in sends if peer == me]
    from_self = [buf for buf, peer in receives if peer == me]
    if len(to_self) != len(from_self):
        raise ValueError(f"rank {me} sends itself {len(to_self)} messages and receives {len(from_self)}")
    for t, buf in zip(to_self, from_self):
        buf.copy_(t)  # a message to oneself: a copy, nothing on the wire
    ops = [dist.P2POp(dist.isend, t, _global(group, peer), group, tag) for t, peer in sends if peer != me]
    ops += [dist.P2POp(dist.irecv, buf, _global(group, peer), group, tag) for buf, peer in receives if peer != me]
    if ledger is not None:
        ledger.count_sends(t for t, peer in sends if peer != me)
    works = dist.batch_isend_irecv(ops) if ops else []
    return Posted([buf for buf, _ in receives], works)
