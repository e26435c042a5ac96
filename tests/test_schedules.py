"""Schedules as data, checked without processes: dependencies, bubbles and in-flight counts against
their closed forms, and PyTorch's plans (tests/test_comm_plan.py: the runner's communication plan)."""

from fractions import Fraction

import pytest
import torch
from rich.console import Console
from schedule_helpers import ALL, MS, PS

from distlab.model_split.schedules import (
    SCHEDULES,
    Action,
    check_schedule,
    gpipe,
    interleaved_1f1b,
    looped,
    make_schedule,
    one_f_one_b,
    round_size,
    v_shape,
    zbv,
    zero_bubble,
)
from distlab.model_split.simulator import dependencies, durations, peak_in_flight, render, simulate
from distlab.model_split.training import PipelineConfig, check_config, microbatch_sizes


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
            idle = {
                name: simulate(s).ticks - 3 * m
                for name, s in (("1f1b", one_f_one_b(p, m)), ("zb-h1", zero_bubble(p, m)))
            }
            assert idle == {"1f1b": 3 * (p - 1), "zb-h1": p - 1}


def in_flight_formula(name: str, p: int, m: int, v: int, r: int) -> int:
    """Most (stage, micro-batch) activations rank r holds; for v > 1 each is a stage of 1/v the layers."""
    g = round_size(p, m) if v > 1 and name.startswith("interleaved") else m
    return {
        "gpipe": m,
        "1f1b": min(m, p - r),
        "looped-bfs": v * m,
        "interleaved-1f1b": min(v * m, (v - 1) * g + 2 * (p - r - 1) + 1),
        "zb-h1": min(m, p),
        "interleaved-zb": min(v * m, (v - 1) * g + p),
        "zbv": 2 * p,
    }[name]


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
        "1F0 1F1 3F0 3I0 3F1 3I1 1F2 1I0 1F3 1I1 3F2 3I2 3F3 3I3 1I2 1I3",
    ]
    # ZB-H1: the last rank holds back P - 1 = 1 weight gradient, the first none.
    assert text(zero_bubble(2, 3)) == ["0F0 0F1 0I0 0W0 0F2 0I1 0W1 0I2 0W2", "1F0 1I0 1F1 1I1 1W0 1F2 1I2 1W1 1W2"]
    # ZB-V on P = 2: rank 0 holds stages 0 and 3 (the V's ends), rank 1 stages 1 and 2 (its turn).
    assert text(zbv(2, 2)) == [
        "0F0 0F1 3F0 3I0 3W0 3F1 3I1 3W1 0I0 0W0 0I1 0W1",
        "1F0 2F0 1F1 2F1 2I0 2W0 1I0 1W0 2I1 2W1 1I1 1W1",
    ]


def _fake_stage(p: int, stages: int, ranks: int):
    """Enough of a PipelineStage for a schedule's constructor to build its plan, no process group."""

    class Stage:
        stage_index, num_stages, group_size, group_rank = p, stages, ranks, 0
        is_first, is_last, submod, stage_index_to_group_rank = p == 0, p == stages - 1, torch.nn.Linear(1, 1), {}

    return Stage()


@pytest.mark.parametrize(
    "ours, theirs, v",
    [
        ("interleaved-1f1b", "ScheduleInterleaved1F1B", 2),
        ("interleaved-1f1b", "ScheduleInterleaved1F1B", 3),
        ("looped-bfs", "ScheduleLoopedBFS", 2),
        ("zb-h1", "ScheduleInterleavedZeroBubble", 1),
        ("interleaved-zb", "ScheduleInterleavedZeroBubble", 2),
        ("zbv", "ScheduleZBVZeroBubble", 2),
    ],
)
def test_our_orders_are_pytorchs_plans_for_every_m_it_accepts(ours, theirs, v):
    """torch 2.13's `pipeline_order` (its I is our split I, its B our unsplit I; None cells dropped)
    equals our schedule for every P <= 6 and M <= 13 its constructor accepts; it refuses the M ours refuses
    (and, with one stage per rank, ScheduleInterleavedZeroBubble refuses some that ours runs: M = 5 on P = 2)."""
    from torch.distributed import pipelining
    from torch.distributed.pipelining.schedules import _ComputationType as kind

    names = {kind.FORWARD: "F", kind.FULL_BACKWARD: "I", kind.BACKWARD_INPUT: "I", kind.BACKWARD_WEIGHT: "W"}
    compared = 0
    for p in PS:
        for m in MS:
            mine = (v_shape(p) if ours == "zbv" else looped(p, v))[0]
            try:
                plan = getattr(pipelining, theirs)(
                    [_fake_stage(s, v * p, p) for s in mine], m, loss_fn=lambda out, target: out.sum()
                ).pipeline_order
            except ValueError:
                if v == 1:  # one stage per rank: rounds play no part, ours runs every M
                    make_schedule(ours, p, m, v)
                else:
                    with pytest.raises(ValueError, match="rounds of equal size"):
                        make_schedule(ours, p, m, v)
                continue
            theirs_as_ours = [
                [Action(names[a.computation_type], a.microbatch_index, a.stage_index) for a in plan[r] if a is not None]
                for r in range(p)
            ]
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
