"""Every collective run once and timed: torch's against one process, a ring by hand against the
formula and against the library's ring, torch's time against the bytes (lesson 06 and its notebook).

`measure_collectives` runs, for each of the four collectives lesson 06 teaches (`MEASURED`; the
all-to-all comes with expert parallelism), torch's version, the ring by hand it is given (lesson 06's
own) and the ground floor's (`distlab.comm.ring.Ring`) on the same inputs; compares torch's and the
hand ring's with the single-process result, the hand ring's with the library's (bit for bit, and the
bytes each sent); and times torch's version (median of `repeats`, slowest rank). Every rank returns its
own rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from distlab.comm.collectives import (
    ALL_GATHER,
    ALL_REDUCE,
    BROADCAST,
    BY_NAME,
    REDUCE_SCATTER,
    check_collective,
    full_numel,
    rank_input,
    ring_bytes,
)
from distlab.comm.ring import RING_RUNS, Ring
from distlab.comm.timing import time_call
from distlab.processes.identity import Runtime
from distlab.proof.compare import tolerances

MEASURED = (ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, BROADCAST)
# (runtime, collective's name, this rank's input) -> (the result, the bytes this rank sent)
ByHand = Callable[[Runtime, str, torch.Tensor], tuple[torch.Tensor, int]]


def library_ring(rt: Runtime, name: str, x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The ground floor's ring (`distlab.comm.ring.Ring`) for collective `name`: (result, bytes sent)."""
    ring = Ring()
    return RING_RUNS[BY_NAME[name]](ring, x), ring.ledger.sent


@dataclass(frozen=True)
class CollectiveRow:
    name: str
    formula: str
    max_err: float  # max |torch's result - one process's|
    ok: bool  # torch's result allclose to one process's
    ring_ok: bool  # the ring by hand's result allclose to one process's
    formula_bytes: int  # what the ring formula says this rank sends
    counted_bytes: int  # what the ring by hand sent from this rank
    same_as_library: bool  # the ring by hand's result = the library ring's, bit for bit, and its bytes too
    seconds: float  # torch's collective: median over the repeats of the slowest rank
    full_bytes: int  # the full tensor


def measure_collectives(
    rt: Runtime, nbytes: int, dtype: torch.dtype, seed: int, repeats: int, by_hand: ByHand = library_ring
) -> list[CollectiveRow]:
    rtol, atol = tolerances(dtype)
    n = full_numel(nbytes, rt.world_size, dtype)
    itemsize = torch.tensor([], dtype=dtype).element_size()
    rows = []
    for c in MEASURED:
        x = rank_input(c, n, rt.rank, rt, seed, dtype)
        got, expected = check_collective(c, rt, n, seed, dtype)
        mine, sent = by_hand(rt, c.name, x)
        library, library_sent = library_ring(rt, c.name, x)
        seconds = time_call(rt, lambda c=c, x=x: c.run(x, rt.world_size), repeats)
        rows.append(
            CollectiveRow(
                c.name,
                c.formula,
                (got.cpu() - expected).abs().max().item(),
                torch.allclose(got.cpu(), expected, rtol=rtol, atol=atol),
                torch.allclose(mine.cpu(), expected, rtol=rtol, atol=atol),
                ring_bytes(c.name, n, itemsize, rt.world_size, rt.rank),
                sent,
                torch.equal(mine, library) and sent == library_sent,
                seconds,
                n * itemsize,
            )
        )
    return rows
