"""The pipeline schedule a configuration runs, read the ways the cost model needs it, each computed once.

The schedule is data (`distlab.model_split.schedules.make_schedule`, lessons 02-05): per rank, its actions in
order. From it: which stages a rank holds (`placement`), on which rank a stage lives (`rank_of`), how many
micro-batches a rank holds activations for at once (`distlab.model_split.simulator.peak_in_flight`), and the
grid of ticks the schedule fills (`simulate`, a forward one tick, a backward two, three with recomputation),
whose idle cells are the bubble. A planner asks the same few questions of thousands of configurations:
they depend on (schedule, pp, M, v) alone, so each is answered once.

DualPipeV and DualPipe (DeepSeek-V3, https://arxiv.org/abs/2412.19437, section 3.2.1) are priced by the closed
forms lesson 19 proves on its grid (their orders live in the lesson, which the library may not import), on the
V placement (v = 2: rank r holds stages r and 2P - 1 - r), a forward, an I and a W one tick each:

    DualPipeV  2P stages of L / 2P layers; per rank 6M ticks of work, P - 1 idle (ZB-V's floor):
               bubble (P - 1) / (6M + P - 1); 2P + 1 half-stage micro-batches in flight on every rank
    DualPipe   two copies of the model, each cut in P chunks of L / P layers: rank r holds chunk r of copy 0
               and chunk P - 1 - r of copy 1 (as stages r and 2P - 1 - r, `distlab.cost.inputs.stage_layers`),
               so 2x the parameters; each micro-batch runs through one of the two (M / 2 each, `passes`):
               per rank 3M whole-chunk ticks of work, P/2 - 1 idle: bubble (P/2 - 1) / (3M + P/2 - 1), that
               is P - 2 idle in half ticks; P + 1 whole-chunk micro-batches in flight on every rank

(M >= 2P for both, torch's ScheduleDualPipeV's rule; DualPipe P and M even.) With recomputation a backward's
I takes a tick more; the idle ticks, the V's turn, are forwards and stay.
"""

from __future__ import annotations

from functools import cache

from distlab.cost.inputs import Batch, Parallel, schedule_of
from distlab.model_split.schedules import placement, rank_of, v_shape
from distlab.model_split.simulator import peak_in_flight, simulate

CLOSED_FORMS = ("dualpipev", "dualpipe")  # lesson 19's schedules, priced by their closed forms (docstring)


def check_closed_form(name: str, pp: int, m: int, v: int) -> None:
    """DualPipe's and DualPipeV's rules (docstring), the first broken one raised in one line."""
    title = {"dualpipev": "DualPipeV", "dualpipe": "DualPipe"}[name]
    if v != 2:
        raise ValueError(f"{title} runs two stages per rank, a V (v = 2), got v = {v}")
    if m < 2 * pp:
        raise ValueError(f"{title} needs M >= 2P micro-batches, got M = {m} at P = {pp}")
    if name == "dualpipe" and (pp % 2 or m % 2):
        raise ValueError(f"DualPipe needs P and M even (M / 2 from each end, no rank its own mirror), got {pp}, {m}")


def passes(parallel: Parallel, batch: Batch) -> int:
    """Micro-batches through each stage a rank holds: M, but M / 2 under DualPipe (half from each end)."""
    return batch.micro_batches // 2 if parallel.schedule == "dualpipe" else batch.micro_batches


def _key(parallel: Parallel, batch: Batch) -> tuple[str, int, int, int]:
    return parallel.schedule, parallel.pp, batch.micro_batches, parallel.stages_per_rank


@cache
def _stages(name: str, pp: int, m: int, v: int) -> tuple[tuple[int, ...], ...]:
    held = v_shape(pp) if name in CLOSED_FORMS else placement(schedule_of(name, pp, m, v))
    return tuple(tuple(sorted(stages)) for stages in held)


@cache
def _in_flight(name: str, pp: int, m: int, v: int) -> tuple[int, ...]:
    if name in CLOSED_FORMS:  # 2P + 1 half stages (DualPipeV), P + 1 whole chunks (DualPipe): lesson 19
        return (2 * pp + 1 if name == "dualpipev" else pp + 1,) * pp
    return tuple(peak_in_flight(schedule_of(name, pp, m, v)))


@cache
def _grid(name: str, pp: int, m: int, v: int, recompute: bool) -> tuple[int, float]:
    if name in CLOSED_FORMS:  # 6M ticks of work a rank (8M with recomputation), P - 1 or P - 2 idle
        work, idle = m * 2 * (4 if recompute else 3), pp - 1 if name == "dualpipev" else pp - 2
        return work + idle, idle / (work + idle)
    timing = simulate(schedule_of(name, pp, m, v), 1, 2 if recompute else 1, 1)
    return timing.ticks, timing.bubble_fraction()


def stages(parallel: Parallel, batch: Batch, pp_rank: int) -> tuple[int, ...]:
    """The stages pipeline rank `pp_rank` holds: r (v = 1); looped r, r + P, ..; a V, r and 2P - 1 - r."""
    return _stages(*_key(parallel, batch))[pp_rank]


@cache
def _owner(name: str, pp: int, m: int, v: int) -> dict[int, int]:
    if name in CLOSED_FORMS:
        return {stage: r for r, held in enumerate(v_shape(pp)) for stage in held}
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
