"""Who a process is: `Runtime`, the one answer to "who am I" that lessons and the library pass around.

A record and nothing else, apart from `distlab.processes.runtime`, which makes the process group and hands one
out: strict device mode (`distlab.processes.strict`) checks tensors against a Runtime's device, and
`distributed(strict=True)` turns that mode on, so both import the record from here and the imports point one way
(identity, then strict, then runtime).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Runtime:
    """Who this process is in the group, and where its tensors live."""

    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: torch.device

    @property
    def is_first(self) -> bool:
        return self.rank == 0
