"""Lesson 19: DualPipeV as data. Without processes: for P = 2..6 and M = 2P..2P+5 its order is a schedule (F and
I once per micro-batch and stage, each W after its I, no deadlock), its grid's bubble is (P-1)/(6M+P-1), ZB-V's,
and every rank holds 2P + 1 half-stage activations at its peak, one more than ZB-V; a twin that runs each pair's
backward before its forward holds 2P, and the check tells it apart; M < 2P is refused in one line naming
--micro-batches, the same on every rank. With processes: the lesson at P = 4 (our runner and torch's
ScheduleDualPipeV equal the unsplit model, torch executes our order) at 80 columns."""

import pytest
from helpers import assert_lesson_passes_at_80_columns, assert_same_error_on_every_rank, load_lesson

from distlab.pipeline.schedules import check_schedule, zbv
from distlab.pipeline.simulator import peak_in_flight, simulate

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
