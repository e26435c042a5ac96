"""Schedules as data, checked without processes: dependencies, bubble, in-flight micro-batches, and
that the runner's communication plan cannot deadlock."""

import itertools

import pytest

from distlab.pipeline.p2p import comm_plan
from distlab.pipeline.runner import check_checkpoint_segments, microbatch_sizes
from distlab.pipeline.schedules import (
    Action, dependencies, gpipe, make_schedule, naive, one_f_one_b, peak_in_flight, render, simulate,
)

CASES = [(p, m) for p in range(1, 7) for m in range(1, 14)]
SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b}


@pytest.mark.parametrize("name", SCHEDULES)
def test_every_dependency_holds_and_each_rank_runs_one_action_per_tick(name):
    for p, m in CASES:
        for f_ticks, b_ticks in [(1, 1), (1, 2)]:
            schedule = SCHEDULES[name](p, m)
            timing = simulate(schedule, f_ticks, b_ticks)
            ticks = {"F": f_ticks, "B": b_ticks}
            for (s, action), start in timing.start.items():
                for dep in dependencies(s, action, p):
                    assert timing.start[dep] + ticks[dep[1].kind] <= start, (p, m, s, action, dep)
            for s, order in enumerate(schedule):
                starts = [timing.start[(s, a)] for a in order]
                assert starts == sorted(starts)  # each rank runs its own list in order
                assert sum(cell is not None for cell in timing.grid[s]) == m * (f_ticks + b_ticks)


def test_dependencies_are_the_three_of_the_pipeline():
    assert dependencies(2, Action("F", 5), 4) == [(1, Action("F", 5))]
    assert dependencies(0, Action("F", 5), 4) == []
    assert dependencies(2, Action("B", 5), 4) == [(2, Action("F", 5)), (3, Action("B", 5))]
    assert dependencies(3, Action("B", 5), 4) == [(3, Action("F", 5))]


@pytest.mark.parametrize("name", SCHEDULES)
def test_bubble_is_p_minus_1_over_m_plus_p_minus_1_for_gpipe_and_1f1b_alike(name):
    for p, m in CASES:
        for f_ticks, b_ticks in [(1, 1), (1, 2), (2, 3)]:
            timing = simulate(SCHEDULES[name](p, m), f_ticks, b_ticks)
            assert timing.ticks == (m + p - 1) * (f_ticks + b_ticks)
            assert timing.bubble_fraction() == pytest.approx((p - 1) / (m + p - 1), abs=1e-15)


def test_peak_in_flight_is_m_for_gpipe_and_min_m_p_minus_s_for_1f1b():
    for p, m in CASES:
        assert peak_in_flight(gpipe(p, m)) == [m] * p
        assert peak_in_flight(one_f_one_b(p, m)) == [min(m, p - s) for s in range(p)]


def test_one_f_one_b_phases():
    schedule = one_f_one_b(4, 6)
    assert [str(a) for a in schedule[0]] == "F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5".split()
    assert [str(a) for a in schedule[3]] == "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5".split()
    # Fewer micro-batches than stages: the first stages never reach a steady state.
    assert [str(a) for a in one_f_one_b(4, 2)[0]] == "F0 F1 B0 B1".split()


def test_naive_is_one_microbatch_and_idles_p_minus_1_of_p():
    assert naive(3) == gpipe(3, 1)
    assert simulate(naive(4)).bubble_fraction() == pytest.approx(3 / 4)


def test_a_contradictory_order_is_reported_as_a_deadlock():
    bad = gpipe(2, 2)
    bad[1] = [Action("F", 0), Action("B", 1), Action("F", 1), Action("B", 0)]  # B1 before F1
    with pytest.raises(ValueError, match="deadlocks: rank 0 at B0, rank 1 at B1"):
        simulate(bad)
    with pytest.raises(ValueError, match="once for each"):
        simulate([[Action("F", 0), Action("B", 0)], [Action("F", 0)]])


def test_bad_input_is_a_clear_error():
    for name in ("gpipe", "1f1b"):
        with pytest.raises(ValueError, match="at least one micro-batch"):
            make_schedule(name, 2, 0)
    with pytest.raises(ValueError, match="unknown schedule"):
        make_schedule("zero-bubble", 2, 2)
    with pytest.raises(ValueError, match="one micro-batch"):
        make_schedule("naive", 2, 3)
    with pytest.raises(ValueError, match="at least one sample"):
        microbatch_sizes(3, 4)
    with pytest.raises(ValueError, match="K = 1 would checkpoint nothing"):
        check_checkpoint_segments(1)
    assert microbatch_sizes(13, 5) == [3, 3, 3, 2, 2]


def test_render_shows_every_action_and_the_idle_cells():
    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(render(simulate(one_f_one_b(2, 3)), title="1F1B"))
    text = console.export_text()
    assert "rank 0" in text and "rank 1" in text
    assert text.count("F2") == 2 and text.count(".") == 4  # P=2, M=3: 2 * 8 cells, 4 idle


# --- The runner's communication plan, replayed for every rank at once ------------------------


def replay(plans, blocking=False):
    """Advance every rank through its batches; a batch completes once every transfer in it has its
    partner posted (a rendezvous, as gloo's send and NCCL's do). Returns True if all ranks finish.
    blocking=True replays naive blocking send/recv instead: one transfer per batch."""
    if blocking:
        plans = [[[t] for batch in plan for t in batch] for plan in plans]
    # The k-th send from a to b matches the k-th receive on b from a: number them per direction.
    ids = []
    for rank, plan in enumerate(plans):
        counters, numbered = {}, []
        for batch in plan:
            row = []
            for t in batch:
                key = (rank, t.peer) if t.op == "send" else (t.peer, rank)
                counters[key, t.op] = counters.get((key, t.op), 0) + 1
                row.append((key, counters[key, t.op], t))
            numbered.append(row)
        ids.append(numbered)
    # The matched transfers must be the same message: same kind, same micro-batch.
    sends = {(k, n): t for plan in ids for batch in plan for k, n, t in batch if t.op == "send"}
    recvs = {(k, n): t for plan in ids for batch in plan for k, n, t in batch if t.op == "recv"}
    assert sends.keys() == recvs.keys()
    assert all((sends[k].what, sends[k].microbatch) == (recvs[k].what, recvs[k].microbatch) for k in sends)

    position = [0] * len(plans)
    posted = set()
    progress = True
    while progress:
        progress = False
        for rank, plan in enumerate(ids):
            if position[rank] == len(plan):
                continue
            batch = plan[position[rank]]
            posted.update((k, n, t.op) for k, n, t in batch)
            partner = {"send": "recv", "recv": "send"}
            if all((k, n, partner[t.op]) in posted for k, n, t in batch):
                position[rank] += 1
                progress = True
    return all(position[r] == len(ids[r]) for r in range(len(plans)))


@pytest.mark.parametrize("name", ["naive", "gpipe", "1f1b"])
def test_the_runners_batched_plan_never_deadlocks(name):
    for p, m in itertools.product(range(1, 7), range(1, 14)):
        if name == "naive" and m > 1:
            continue
        schedule = make_schedule(name, p, m)
        assert replay([comm_plan(actions, s, p) for s, actions in enumerate(schedule)]), (name, p, m)


def test_the_replay_catches_the_deadlock_of_blocking_send_recv_in_1f1b():
    """Guard against a replay that cannot fail: blocking send/recv in 1F1B's order deadlocks."""
    schedule = one_f_one_b(2, 3)
    plans = [comm_plan(actions, s, 2) for s, actions in enumerate(schedule)]
    assert replay(plans)
    assert not replay(plans, blocking=True)
    # GPipe's order is safe even with blocking transfers: nobody sends both ways at once.
    assert replay([comm_plan(a, s, 2) for s, a in enumerate(gpipe(2, 3))], blocking=True)
