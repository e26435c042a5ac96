"""What one rank sent, counted: the measured side of every byte formula in distlab.

A `Ledger` holds exact integers. `sent` is the total, `sent_by[phase, kind]` the part of it sent in
one phase of the step (a name the caller chooses: "forward", "backward", "gradients", ...) by one kind
of communication (a collective's name, or "send" for point-to-point messages); `calls` counts the
calls the same way. Two ways in:

- a point-to-point message counts the bytes handed to the transport (`count_sends`; the exchange in
  `distlab.comm.p2p` calls it for every message that leaves the rank);
- a collective run by the library (torch's `all_reduce`, ...) counts what a ring algorithm sends for
  it (`record`, with the fractions of `distlab.comm.collectives`): the bytes the ring by hand of
  `distlab.comm.ring` hands to its messages for the same call, so the two ways agree.

A prediction is never called `sent`: formulas are named `expected_*` (`expected_traffic`,
`expected_bytes`, ...), so a table that puts a count beside a formula says which is which.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from distlab.comm.collectives import ring_bytes

SEND = "send"  # the kind of a point-to-point message


@dataclass
class Ledger:
    """Bytes this rank sent, by (phase, kind); the number of calls, the same way."""

    sent_by: Counter = field(default_factory=Counter)
    calls: Counter = field(default_factory=Counter)

    @property
    def sent(self) -> int:
        """Every byte this rank sent since the ledger was made (or cleared)."""
        return sum(self.sent_by.values())

    def sent_in(self, phase: str) -> int:
        """The bytes sent in one phase, whatever the kind."""
        return sum(n for (p, _), n in self.sent_by.items() if p == phase)

    def add(self, phase: str, kind: str, nbytes: int) -> None:
        if not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"a ledger counts whole bytes: got {nbytes!r} for ({phase!r}, {kind!r})")
        self.sent_by[phase, kind] += nbytes
        self.calls[phase, kind] += 1

    def count_sends(self, tensors: Iterable[torch.Tensor], phase: str = "") -> None:
        """Point-to-point messages leaving this rank: their bytes, as handed to the transport."""
        for t in tensors:
            self.add(phase, SEND, t.numel() * t.element_size())

    def record(self, phase: str, kind: str, full: torch.Tensor, group=None) -> None:
        """A collective `kind` over `group` (None: the world) on the full tensor `full` (the reduced one,
        the gathered one, the broadcast one, one rank's all_to_all input): what a ring sends for it."""
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        self.add(phase, kind, ring_bytes(kind, full.numel(), full.element_size(), world, rank))

    def clear(self) -> None:
        self.sent_by.clear()
        self.calls.clear()
