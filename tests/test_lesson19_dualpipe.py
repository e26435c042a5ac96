"""Lesson 19: DualPipeV as data. Without processes: for P = 2..6 and M = 2P..2P+5 its order is a schedule (F and
I once per micro-batch and stage, each W after its I, no deadlock), its grid's bubble is (P-1)/(6M+P-1), ZB-V's,
and every rank holds 2P + 1 half-stage activations at its peak, one more than ZB-V; a twin that runs each pair's
backward before its forward holds 2P, and the check tells it apart; M < 2P is refused in one line naming
--micro-batches, the same on every rank. With processes: the lesson at P = 4 (our runner and torch's
ScheduleDualPipeV equal the unsplit model, torch executes our order) at 80 columns.

DualPipe in both directions. Without processes, for P = 2, 4, 6, 8 and even M = 2P..2P+6: every action sits on the
rank that holds its chain's position, each chain's micro-batches stay in their chain, F and I run once per
micro-batch and stage with each W after its I, and the order runs without deadlock; the bubble is
(P/2-1)/(3M+P/2-1) and every rank holds P + 1 whole-chunk activations (a twin that runs each pair's backward first
holds fewer; a twin in which every rank calls chain 0 its own puts actions on the wrong ranks; pairs run as one
unit idle twice as long); with pairs as one unit every rank idles DeepSeek's (P/2-1)(F&B+B-3W) at F = I = W, F&B = 3,
the worst rank does at F&B = 2 and 2.5, and with I != W it does not hold. The unit simulator equals the library's
on DualPipeV (its independent check). Odd P or M, or M < 2P, is refused in one line naming the flag, the same on
every rank. With processes (P = 2): the two copies with their mirrors summed equal the unsplit model on every rank
(float64) and each other bit for bit; the twin that skips the sum does neither."""

from collections import Counter

import pytest
import torch
from helpers import (
    assert_lesson_passes_at_80_columns,
    assert_same_error_on_every_rank,
    load_lesson,
    per_config,
)

from distlab.model_split.schedules import check_schedule, zbv
from distlab.model_split.simulator import dependencies, peak_in_flight, simulate
from distlab.model_split.training import PipelineConfig, unsplit_reference
from distlab.model_split.two_chains import UNIT, chain_rank, simulate_units, two_chain_dependencies
from distlab.processes.spawn import spawn
from distlab.proof.compare import all_ok, compare

CASES = [(p, m) for p in range(2, 7) for m in range(2 * p, 2 * p + 6)]


@pytest.fixture(scope="module")
def lesson():
    return load_lesson("dualpipe")


@pytest.mark.parametrize(("world", "m"), CASES)
def test_dualpipev_is_a_schedule_with_zbv_s_bubble_and_one_more_activation(lesson, world, m):
    schedule = lesson.flatten(lesson.dualpipev(world, m))
    assert check_schedule(schedule) == m and len(schedule) == world
    timing = simulate(schedule)  # raises on a deadlock
    assert abs(timing.bubble_fraction() - (world - 1) / (6 * m + world - 1)) < 1e-12
    assert timing.ticks == simulate(zbv(world, m)).ticks == 6 * m + world - 1
    assert peak_in_flight(schedule) == [2 * world + 1] * world
    assert peak_in_flight(zbv(world, m)) == [2 * world] * world
    assert lesson.formulas("dualpipev", world, m) == (timing.bubble_fraction(), peak_in_flight(schedule))


@pytest.mark.parametrize("world", [2, 3, 4])
def test_the_pairs_are_the_steady_state_and_the_in_flight_check_sees_their_order(lesson, world):
    m = 2 * world + 2
    ticks = lesson.dualpipev(world, m)
    for r, order in enumerate(ticks):
        pairs = [unit for unit in order if len(unit) == 2]
        assert len(pairs) == 2 * (m - 2 * world + r + 1) - (r == world - 1) + (world - r - 1)
        assert all(f.kind == "F" and b.kind == "I" and f.stage != b.stage for f, b in pairs)
    backward_first = [[a for unit in order for a in reversed(unit)] for order in ticks]  # the wrong twin
    held = peak_in_flight(backward_first)  # rank P - 1's unpaired first F, B still peaks at 2P + 1
    assert held[:-1] == [2 * world] * (world - 1) and held != lesson.formulas("dualpipev", world, m)[1]


def _check(rt, m):
    load_lesson("dualpipe").check_microbatches(rt.world_size, m)


def test_fewer_than_2p_micro_batches_are_refused_on_every_rank(lesson):
    message = assert_same_error_on_every_rank(_check, 2, 3, match="--micro-batches")
    assert "M >= 2P = 4" in message and "M = 3" in message and "\n" not in message
    with pytest.raises(ValueError, match="M >= 2P = 8"):
        lesson.dualpipev(4, 7)


def test_the_lesson_passes():
    out = assert_lesson_passes_at_80_columns("19_dualpipe.py", 4, "--emulate-ms", "2")
    assert "executes our order" in out and "DualPipeV" in out


# ---- DualPipe in both directions -------------------------------------------------------------------

DUAL = [(p, m) for p in (2, 4, 6, 8) for m in range(2 * p, 2 * p + 7, 2)]


def _placed_and_complete(lesson, ticks, world, m) -> bool:
    """Each action on its position's rank, in its own chain's micro-batches; F and I once per (stage, micro-batch)
    of its chain, at most one W, after the I."""
    actions = [(r, a) for r, order in enumerate(ticks) for unit in order for a in unit]
    if any(chain_rank(a.stage, world) != r or a.microbatch // (m // 2) != a.stage // world for r, a in actions):
        return False
    counts = Counter((a.kind, a.stage, a.microbatch) for _, a in actions)
    every = [(s, i) for s in range(2 * world) for i in range(m) if i // (m // 2) == s // world]
    for order in lesson.flatten(ticks):
        for a in order:
            if a.kind == "W" and order.index(a) < order.index(lesson.Action("I", a.microbatch, a.stage)):
                return False
    return all(counts["F", s, i] == counts["I", s, i] == 1 and counts["W", s, i] <= 1 for s, i in every)


@pytest.mark.parametrize(("world", "m"), DUAL)
def test_dualpipe_is_two_chains_with_its_closed_forms(lesson, world, m):
    ticks = lesson.dualpipe(world, m)
    assert _placed_and_complete(lesson, ticks, world, m)
    timing = lesson.dualpipe_timing(world, m)  # raises on a deadlock
    bubble, held = lesson.dualpipe_formulas(world, m)
    assert timing.ticks == 3 * m + world // 2 - 1 and abs(timing.bubble_fraction() - bubble) < 1e-12
    assert peak_in_flight(lesson.flatten(ticks)) == held == [world + 1] * world
    backward_first = [[a for unit in order for a in reversed(unit)] for order in ticks]  # the wrong twin
    if world >= 4:  # at P = 2 each rank is the V's turn, whose first F, B is no pair (as rank P - 1 above)
        assert peak_in_flight(backward_first) != held


def test_a_twin_that_calls_chain_0_everyones_own_is_misplaced(lesson):
    world, m, half = 4, 8, 4
    v = lesson.dualpipev(world // 2, half)
    twin = []
    for r in range(world):
        h = min(r, world - 1 - r)
        relabel = [
            lesson.Action(
                a.kind,
                a.microbatch if a.stage == h else half + a.microbatch,
                a.stage if a.stage == h else world + a.stage,
            )
            for a in sum(v[h], ())
        ]
        twin.append([(a,) for a in relabel])
    assert not _placed_and_complete(lesson, twin, world, m)


def _idle(lesson, world, m, cost, together):
    deps = lambda a: two_chain_dependencies(a, world)  # noqa: E731
    return simulate_units(lesson.dualpipe(world, m), deps, cost, together=together)[1]


@pytest.mark.parametrize("world", [4, 6, 8])
def test_deepseek_s_bubble_is_the_pairs_as_one_unit(lesson, world):
    """DeepSeek-V3's (P/2-1)(F&B+B-3W): every rank's idle time at F = I = W = 1, F&B = 3; the worst rank's at
    F&B = 2, 2.5; neither with I != W. The runner's split grid idles half of it."""
    m, unit = 2 * world + 4, dict(UNIT)
    exact = lesson.deepseek_bubble(world, unit)
    assert set(_idle(lesson, world, m, unit, True)) == {exact} == {2 * (world // 2 - 1)}
    assert set(_idle(lesson, world, m, unit, False)) == {world // 2 - 1} != {exact}  # the split grid: half of it
    for fb in (2, 2.5):
        cost = {**unit, "FB": fb}
        assert max(_idle(lesson, world, m, cost, True)) == lesson.deepseek_bubble(world, cost)
    uneven = {"F": 1, "I": 1.5, "W": 0.5, "B": 2, "FB": 2.5}
    assert max(_idle(lesson, world, m, uneven, True)) < lesson.deepseek_bubble(world, uneven)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_the_unit_simulator_equals_the_library_s_on_dualpipev(lesson, world):
    for m in range(2 * world, 2 * world + 3):
        ticks = lesson.dualpipev(world, m)
        step, idle, _ = simulate_units(ticks, lambda a: dependencies(a, 2 * world), UNIT)
        timing = simulate(lesson.flatten(ticks))
        assert step == timing.ticks and idle == [row.count(None) for row in timing.grid]


def test_dualpipe_refuses_odd_m_and_odd_p_in_one_line(lesson):
    """A pure function of (P, M), which every rank knows, called by the lesson's world_rules before any
    collective: the same line on every rank (the spawned check above shows the pattern for DualPipeV's)."""
    with pytest.raises(ValueError, match="--micro-batches: .* M even .* got M = 9") as err:
        lesson.dualpipe(4, 9)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="--nproc-per-node: .* P = 3"):
        lesson.dualpipe(3, 6)
    with pytest.raises(ValueError, match="M >= 2P = 8, got M = 6"):
        lesson.dualpipe(4, 6)


CFG = PipelineConfig(
    widths=(4, *[6] * 4, 3), global_batch=12, micro_batches=4, steps=2, lr=0.2, seed=3, gather_spans=False
)


def _dual_and_unsummed(rt):
    """Both on one process group: the runner, and its twin that skips the mirrors' sum."""
    from distlab.model_split.training import train

    lesson = load_lesson("dualpipe")
    return [train(rt, CFG, lesson.dualpipe_step(rt, CFG, sum_mirrors=s)) for s in (True, False)]


def _every_rank_exact(ranks, ref) -> bool:
    return all(
        all_ok(compare({n: ref.first_grads[n] for n in run.first_grads}, run.first_grads))
        and all_ok(compare({n: ref.params[n] for n in run.params}, run.params))
        for run in ranks
    )


def test_dualpipe_equals_the_unsplit_model_and_the_unsummed_twin_does_not():
    ref = unsplit_reference(CFG)
    good, twin = per_config(spawn(_dual_and_unsummed, 2))
    assert _every_rank_exact(good, ref) and abs(good[0].losses[1] - ref.losses[1]) < 1e-12
    assert not _every_rank_exact(twin, ref)
    assert _copies_equal(good) and not _copies_equal(twin)  # the lesson's bit-for-bit claim, and its twin


def _copies_equal(ranks) -> bool:
    """At P = 2 rank 0 holds chunk 0 of copy 0 and chunk 1 of copy 1, rank 1 the other copies: equal bit for bit."""
    (first, second) = (ranks[0].params, ranks[1].params)
    return first.keys() == second.keys() and all(torch.equal(first[n], second[n]) for n in first)
