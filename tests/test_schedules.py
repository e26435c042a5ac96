"""Schedules as data, checked without processes: dependencies, bubbles and in-flight counts against
their closed forms, PyTorch's plans, and that the runner's communication plan cannot deadlock."""

from fractions import Fraction

import pytest
import torch
from rich.console import Console

from distlab.pipeline.p2p import Transfer, comm_plan, produces
from distlab.pipeline.schedules import (
    SCHEDULES, Action, check_schedule, gpipe, interleaved_1f1b, looped, make_schedule, one_f_one_b,
    round_size, v_shape, zbv, zero_bubble,
)
from distlab.pipeline.simulator import dependencies, durations, peak_in_flight, render, simulate
from distlab.pipeline.training import PipelineConfig, check_config, microbatch_sizes

PS, MS = range(1, 7), range(1, 14)


def every_schedule(vs=(2, 3)):
    """(name, P, M, v, schedule) for every schedule and every (P, M, v) it allows, P <= 6, M <= 13."""
    for name, kind in SCHEDULES.items():
        for v in kind.allowed_v or vs:
            for p in PS:
                for m in MS:
                    try:
                        yield name, p, m, v, make_schedule(name, p, m, v)
                    except ValueError as err:
                        assert "rounds of equal size" in str(err), err  # the only refusal


ALL = list(every_schedule())


def test_every_dependency_holds_and_each_rank_runs_its_order_one_action_at_a_time():
    for name, p, m, v, schedule in ALL[::3]:
        for costs in [(1, 1, 1), (1, 2, 1), (2, 3, 1)]:
            timing = simulate(schedule, *costs)
            took = durations(schedule, *costs)
            stages = v * p
            for action, start in timing.start.items():
                for dep in dependencies(action, stages):
                    assert timing.start[dep] + took[dep] <= start, (name, p, m, action, dep)
            for r, order in enumerate(schedule):
                starts = [timing.start[a] for a in order]
                assert starts == sorted(starts)  # each rank runs its own list in order
                assert sum(cell is not None for cell in timing.grid[r]) == sum(took[a] for a in order)


def test_placement_is_looped_or_v_shaped():
    assert looped(3, 2) == [[0, 3], [1, 4], [2, 5]] and v_shape(3) == [[0, 5], [1, 4], [2, 3]]
    for name, p, m, v, schedule in ALL:
        stages = [sorted({a.stage for a in order}) for order in schedule]
        assert stages == [sorted(s) for s in (v_shape(p) if name == "zbv" else looped(p, v))], (name, p, v)
        assert check_schedule(schedule) == m


def test_dependencies_are_the_three_of_the_pipeline():
    assert dependencies(Action("F", 5, 2), 4) == [Action("F", 5, 1)]
    assert dependencies(Action("F", 5, 0), 4) == []
    assert dependencies(Action("I", 5, 2), 4) == [Action("F", 5, 2), Action("I", 5, 3)]
    assert dependencies(Action("I", 5, 3), 4) == [Action("F", 5, 3)]
    assert dependencies(Action("W", 5, 1), 4) == [Action("I", 5, 1)]


def bubble_formula(name: str, p: int, m: int, v: int) -> Fraction:
    """The closed forms, unit costs (F = I = W = 1 tick, an unsplit backward 2):
    - GPipe, 1F1B, interleaved 1F1B, looped BFS: each rank idles 3 (P - 1) ticks of 3 v M + 3 (P - 1):
      (P - 1) / (v M + P - 1), the interleaved ones with v times fewer idle stage-lengths.
    - ZB-H1, interleaved zero bubble, ZB-V: each rank idles P - 1 ticks of 3 v M + P - 1, the floor:
      rank P - 1 cannot start before tick P - 1, and every rank has 3 v M ticks of work."""
    if name in ("gpipe", "1f1b", "interleaved-1f1b", "looped-bfs"):
        return Fraction(p - 1, v * m + p - 1)
    return Fraction(p - 1, 3 * v * m + p - 1)


def test_bubbles_equal_their_closed_forms():
    for name, p, m, v, schedule in ALL:
        if m < p or (name == "zbv" and m < 2 * p):
            continue  # the forms hold once the pipeline fills: M >= P (ZB-V: M >= 2P)
        timing = simulate(schedule)
        idle = sum(cell is None for row in timing.grid for cell in row)
        assert Fraction(idle, p * timing.ticks) == bubble_formula(name, p, m, v), (name, p, m, v)


def test_gpipe_and_1f1b_bubble_holds_for_any_costs_and_any_m():
    for p in PS:
        for m in MS:
            for f, i, w in [(1, 1, 1), (1, 2, 1), (2, 3, 1), (1, 1, 3)]:
                for schedule in (gpipe(p, m), one_f_one_b(p, m)):
                    timing = simulate(schedule, f, i, w)
                    assert timing.ticks == (m + p - 1) * (f + i + w)
                    assert timing.bubble_fraction() == pytest.approx((p - 1) / (m + p - 1), abs=1e-15)


def test_zb_h1_idles_a_third_of_one_f_one_b():
    for p in range(2, 7):
        for m in range(p, 14):
            idle = {name: simulate(s).ticks - 3 * m for name, s in (("1f1b", one_f_one_b(p, m)),
                                                                    ("zb-h1", zero_bubble(p, m)))}
            assert idle == {"1f1b": 3 * (p - 1), "zb-h1": p - 1}


def in_flight_formula(name: str, p: int, m: int, v: int, r: int) -> int:
    """Most (stage, micro-batch) activations rank r holds; for v > 1 each is a stage of 1/v the layers."""
    g = round_size(p, m) if v > 1 and name.startswith("interleaved") else m
    return {"gpipe": m, "1f1b": min(m, p - r), "looped-bfs": v * m,
            "interleaved-1f1b": min(v * m, (v - 1) * g + 2 * (p - r - 1) + 1),
            "zb-h1": min(m, p), "interleaved-zb": min(v * m, (v - 1) * g + p), "zbv": 2 * p}[name]


def test_peak_in_flight_equals_its_closed_form():
    for name, p, m, v, schedule in ALL:
        if name == "zbv" and m < 2 * p:
            continue  # ZB-V holds 2P half-size stages (P whole ones, 1F1B's rank 0) once M >= 2P
        assert peak_in_flight(schedule) == [in_flight_formula(name, p, m, v, r) for r in range(p)], (name, p, m, v)


def test_orders_read_as_the_papers_draw_them():
    def text(schedule):
        return [" ".join(a.label for a in order) for order in schedule]

    assert [str(a) for a in one_f_one_b(4, 6)[0]] == "F0 F1 F2 F3 I0 F4 I1 F5 I2 I3 I4 I5".split()
    assert [str(a) for a in one_f_one_b(4, 6)[3]] == "F0 I0 F1 I1 F2 I2 F3 I3 F4 I4 F5 I5".split()
    assert [str(a) for a in one_f_one_b(4, 2)[0]] == "F0 F1 I0 I1".split()  # M < P: no steady state
    assert text(interleaved_1f1b(2, 4)) == [
        "0F0 0F1 2F0 2F1 0F2 2I0 0F3 2I1 2F2 0I0 2F3 0I1 2I2 2I3 0I2 0I3",
        "1F0 1F1 3F0 3I0 3F1 3I1 1F2 1I0 1F3 1I1 3F2 3I2 3F3 3I3 1I2 1I3"]
    # ZB-H1: the last rank holds back P - 1 = 1 weight gradient, the first none.
    assert text(zero_bubble(2, 3)) == ["0F0 0F1 0I0 0W0 0F2 0I1 0W1 0I2 0W2",
                                       "1F0 1I0 1F1 1I1 1W0 1F2 1I2 1W1 1W2"]
    # ZB-V on P = 2: rank 0 holds stages 0 and 3 (the V's ends), rank 1 stages 1 and 2 (its turn).
    assert text(zbv(2, 2)) == ["0F0 0F1 3F0 3I0 3W0 3F1 3I1 3W1 0I0 0W0 0I1 0W1",
                               "1F0 2F0 1F1 2F1 2I0 2W0 1I0 1W0 2I1 2W1 1I1 1W1"]


def _fake_stage(p: int, stages: int, ranks: int):
    """Enough of a PipelineStage for a schedule's constructor to build its plan, no process group."""
    class Stage:
        stage_index, num_stages, group_size, group_rank = p, stages, ranks, 0
        is_first, is_last, submod, stage_index_to_group_rank = p == 0, p == stages - 1, torch.nn.Linear(1, 1), {}
    return Stage()


@pytest.mark.parametrize("ours, theirs, v", [("interleaved-1f1b", "ScheduleInterleaved1F1B", 2),
                                             ("interleaved-1f1b", "ScheduleInterleaved1F1B", 3),
                                             ("looped-bfs", "ScheduleLoopedBFS", 2),
                                             ("zb-h1", "ScheduleInterleavedZeroBubble", 1),
                                             ("interleaved-zb", "ScheduleInterleavedZeroBubble", 2),
                                             ("zbv", "ScheduleZBVZeroBubble", 2)])
def test_our_orders_are_pytorchs_plans_for_every_m_it_accepts(ours, theirs, v):
    """torch 2.13's `pipeline_order` (its I is our split I, its B our unsplit I; None cells dropped)
    equals our schedule for every P <= 6 and M <= 13 its constructor accepts; it refuses the M ours refuses (and, with one
    stage per rank, ScheduleInterleavedZeroBubble refuses some that ours runs: M = 5 on P = 2)."""
    from torch.distributed import pipelining
    from torch.distributed.pipelining.schedules import _ComputationType as kind

    names = {kind.FORWARD: "F", kind.FULL_BACKWARD: "I", kind.BACKWARD_INPUT: "I", kind.BACKWARD_WEIGHT: "W"}
    compared = 0
    for p in PS:
        for m in MS:
            mine = (v_shape(p) if ours == "zbv" else looped(p, v))[0]
            try:
                plan = getattr(pipelining, theirs)([_fake_stage(s, v * p, p) for s in mine], m,
                                                   loss_fn=lambda out, target: out.sum()).pipeline_order
            except ValueError:
                if v == 1:  # one stage per rank: rounds play no part, ours runs every M
                    make_schedule(ours, p, m, v)
                else:
                    with pytest.raises(ValueError, match="rounds of equal size"):
                        make_schedule(ours, p, m, v)
                continue
            theirs_as_ours = [[Action(names[a.computation_type], a.microbatch_index, a.stage_index)
                               for a in plan[r] if a is not None] for r in range(p)]
            assert theirs_as_ours == make_schedule(ours, p, m, v), (p, m)
            compared += 1
    assert compared >= 60


def test_one_microbatch_idles_p_minus_1_of_p():  # lesson 01's naive model parallelism, as a grid
    assert simulate(gpipe(4, 1)).bubble_fraction() == pytest.approx(3 / 4)


def test_a_contradictory_order_is_reported_as_a_deadlock():
    bad = gpipe(2, 2)
    bad[1] = [Action("F", 0, 1), Action("I", 1, 1), Action("F", 1, 1), Action("I", 0, 1)]  # I1 before F1
    with pytest.raises(ValueError, match="deadlocks: rank 0 at 0I0, rank 1 at 1I1"):
        simulate(bad)
    with pytest.raises(ValueError, match="once for each"):
        simulate([[Action("F", 0, 0), Action("I", 0, 0)], [Action("F", 0, 1)]])
    with pytest.raises(ValueError, match="appears twice"):
        check_schedule([[Action("F", 0, 0), Action("F", 0, 0), Action("I", 0, 0)]])


def test_bad_input_is_a_clear_error():
    for name in SCHEDULES:
        with pytest.raises(ValueError, match="at least one micro-batch"):
            make_schedule(name, 2, 0, SCHEDULES[name].allowed_v[0] if SCHEDULES[name].allowed_v else 2)
    with pytest.raises(ValueError, match="unknown schedule"):
        make_schedule("zero-bubble", 2, 2)
    with pytest.raises(ValueError, match=r"ZB-V takes v in \[2\]"):
        make_schedule("zbv", 2, 4, 3)
    with pytest.raises(ValueError, match="takes v >= 2"):
        make_schedule("interleaved-1f1b", 2, 4, 1)
    with pytest.raises(ValueError, match="rounds of equal size: M=9 on P=4"):
        make_schedule("interleaved-1f1b", 4, 9, 2)
    with pytest.raises(ValueError, match="at least one row"):
        microbatch_sizes(3, 4)
    with pytest.raises(ValueError, match="K = 1 would checkpoint nothing"):
        check_config(PipelineConfig(micro_batches=2, checkpoint_segments=1))
    assert microbatch_sizes(13, 5) == [3, 3, 3, 2, 2]


def test_render_folds_wide_grids_into_blocks_that_fit():
    for width in (80, 120):
        console = Console(width=width, record=True, color_system=None)
        timing = simulate(interleaved_1f1b(4, 8))
        console.print(render(timing, title="interleaved", width=width))
        lines = console.export_text().splitlines()
        assert max(len(line) for line in lines) <= width
        cells = [c for line in lines if line.startswith("rank 0") for c in line.split()[2:]]
        assert len(cells) == timing.ticks  # every tick shown, in blocks, none dropped
        assert cells.count("0F3") == 1 and cells.count("4I0") == 2  # an unsplit backward takes two ticks


def test_compact_grids_share_one_time_axis_and_fold_too():
    console = Console(width=40, record=True, color_system=None)
    console.print(render(simulate(gpipe(4, 8)), compact=True, stretch=2, width=40))
    lines = console.export_text().splitlines()
    rows = [line for line in lines if line.startswith("rank 0")]
    assert max(len(line) for line in lines) <= 40
    assert "".join(line[7:] for line in rows) == "F" * 16 + "." * 18 + "I" * 32  # 33 ticks, two characters each


# --- The runner's communication plan, replayed for every rank at once ------------------------


def replay(plans: list[list[list[Transfer]]]) -> bool:
    """Advance every rank through its batches; a batch completes once every transfer in it has its
    partner posted (a rendezvous, as gloo's send and NCCL's do). True if every rank finishes.
    Also checks that the k-th message a rank sends another is the k-th that one receives."""
    numbered = []
    for rank, plan in enumerate(plans):
        counters: dict = {}
        rows = []
        for batch in plan:
            row = []
            for t in batch:
                pair = (rank, t.peer) if t.op == "send" else (t.peer, rank)
                counters[pair, t.op] = counters.get((pair, t.op), 0) + 1
                row.append((pair, counters[pair, t.op], t))
            rows.append(row)
        numbered.append(rows)
    sends = {(k, n): t for rows in numbered for row in rows for k, n, t in row if t.op == "send"}
    recvs = {(k, n): t for rows in numbered for row in rows for k, n, t in row if t.op == "recv"}
    assert sends.keys() == recvs.keys()
    assert all(sends[k].message == recvs[k].message for k in sends)

    position, posted, progress = [0] * len(plans), set(), True
    partner = {"send": "recv", "recv": "send"}
    while progress:
        progress = False
        for rank, rows in enumerate(numbered):
            if position[rank] == len(rows):
                continue
            before = len(posted)
            posted.update((k, n, t.op) for k, n, t in rows[position[rank]])
            progress |= len(posted) > before
            if all((k, n, partner[t.op]) in posted for k, n, t in rows[position[rank]]):
                position[rank] += 1
                progress = True
    return all(position[r] == len(numbered[r]) for r in range(len(plans)))


def blocking_plan(schedule, rank: int) -> list[list[Transfer]]:
    """What plain blocking send/recv would do: before each action receive its input, after it send
    its output, one transfer at a time (lesson 01's chain, applied to a schedule)."""
    where = {p: r for r, order in enumerate(schedule) for a in order for p in [a.stage]}
    stages, plan = len(where), []
    for a in schedule[rank]:
        source = a.stage - 1 if a.kind == "F" else a.stage + 1
        if a.kind != "W" and 0 <= source < stages and where[source] != rank:
            plan.append([Transfer("recv", where[source], "activation" if a.kind == "F" else "gradient",
                                  a.microbatch, a.stage)])
        made = produces(a, stages)
        if made and where[made[1]] != rank:
            plan.append([Transfer("send", where[made[1]], made[0], a.microbatch, made[1])])
    return plan


def test_the_runners_plan_never_deadlocks_and_matches_every_message():
    for name, p, m, v, schedule in ALL:
        timing = simulate(schedule)
        assert replay([comm_plan(schedule, r, timing) for r in range(p)]), (name, p, m, v)


def test_the_replay_catches_the_deadlock_of_blocking_send_recv_in_1f1b():
    """Guard against a replay that cannot fail: blocking send/recv in 1F1B's order deadlocks, in
    GPipe's it does not (nobody sends both ways at once)."""
    assert not replay([blocking_plan(one_f_one_b(2, 3), r) for r in range(2)])
    assert replay([blocking_plan(gpipe(2, 3), r) for r in range(2)])
    assert replay([comm_plan(one_f_one_b(2, 3), r) for r in range(2)])
