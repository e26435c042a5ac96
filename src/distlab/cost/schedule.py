"""The pipeline schedule a configuration runs, read the ways the cost model needs it, each computed once.

The schedule is data (`distlab.model_split.schedules.make_schedule`, lessons 02-05): per rank, its actions in
order. From it: which stages a rank holds (`placement`), on which rank a stage lives (`rank_of`), how many
micro-batches a rank holds activations for at once (`distlab.model_split.simulator.peak_in_flight`), and the
grid of ticks the schedule fills (`simulate`, a forward one tick, a backward two, three with recomputation),
whose idle cells are the bubble. A planner asks the same few questions of thousands of configurations:
they depend on (schedule, pp, M, v) alone, so each is answered once.
"""

from __future__ import annotations

from functools import cache

from distlab.cost.inputs import Batch, Parallel, schedule_of
from distlab.model_split.schedules import placement, rank_of
from distlab.model_split.simulator import peak_in_flight, simulate


def _key(parallel: Parallel, batch: Batch) -> tuple[str, int, int, int]:
    return parallel.schedule, parallel.pp, batch.micro_batches, parallel.stages_per_rank


@cache
def _stages(name: str, pp: int, m: int, v: int) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(stages) for stages in placement(schedule_of(name, pp, m, v)))


@cache
def _in_flight(name: str, pp: int, m: int, v: int) -> tuple[int, ...]:
    return tuple(peak_in_flight(schedule_of(name, pp, m, v)))


@cache
def _grid(name: str, pp: int, m: int, v: int, recompute: bool) -> tuple[int, float]:
    timing = simulate(schedule_of(name, pp, m, v), 1, 2 if recompute else 1, 1)
    return timing.ticks, timing.bubble_fraction()


def stages(parallel: Parallel, batch: Batch, pp_rank: int) -> tuple[int, ...]:
    """The stages pipeline rank `pp_rank` holds: r (v = 1); looped r, r + P, ..; a V, r and 2P - 1 - r."""
    return _stages(*_key(parallel, batch))[pp_rank]


@cache
def _owner(name: str, pp: int, m: int, v: int) -> dict[int, int]:
    return rank_of(schedule_of(name, pp, m, v))


def owner(parallel: Parallel, batch: Batch) -> dict[int, int]:
    """The rank each stage lives on."""
    return _owner(*_key(parallel, batch))


def in_flight(parallel: Parallel, batch: Batch, pp_rank: int) -> int:
    """The most micro-batches (stage, micro-batch pairs) the rank holds activations for at once."""
    return _in_flight(*_key(parallel, batch))[pp_rank]


def grid(parallel: Parallel, batch: Batch) -> tuple[int, float]:
    """(ticks, bubble fraction) of the schedule's grid: a forward one tick, a backward two (three with
    recomputation)."""
    return _grid(*_key(parallel, batch), parallel.recompute)
