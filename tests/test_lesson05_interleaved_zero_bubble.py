"""Lesson 05: interleaved 1F1B and the zero-bubble schedules, run by our runner (several stages per
rank, every backward split into I and W), train exactly like the unsplit model; so does each of
torch.distributed.pipelining's seven schedules, which executes our order wherever we share one."""

import json

import pytest
from helpers import (
    assert_flag_refused,
    assert_lesson_passes_at_80_columns,
    equals_reference,
    merged,
    per_config,
    torch_step,
    train_each,
)

from distlab.model_split.runner import PipelineStep
from distlab.model_split.schedules import make_schedule
from distlab.model_split.simulator import peak_in_flight
from distlab.model_split.training import PipelineConfig, unsplit_reference
from distlab.processes.spawn import spawn
from distlab.proof.compare import all_ok, compare

# 9 layers: v P = 8 stages at P = 4 (one stage holds two layers). N = 13 rows: uneven micro-batches
# for every M > 1 here; K = 2 on some runs, so checkpointing meets the I/W split too.
CFG = PipelineConfig(widths=(6, *[8] * 8, 4), global_batch=13, steps=2, lr=0.2, seed=3, gather_spans=False)
OURS = {"interleaved-1f1b": 2, "zb-h1": 1, "interleaved-zb": 2, "zbv": 2, "looped-bfs": 2}


@pytest.mark.parametrize("world_size", [2, 4])
def test_interleaved_and_zero_bubble_runs_equal_the_unsplit_model(world_size):
    p = world_size
    configs = []
    for name, v in OURS.items():
        for m in (p, 2 * p, 2 * p + 1):
            try:
                make_schedule(name, p, m, v)
            except ValueError:
                continue  # the interleaved schedules' rounds must divide M: 2P + 1 is refused
            configs.append(
                CFG.replace(
                    schedule=name, stages_per_rank=v, micro_batches=m, checkpoint_segments=2 if m == 2 * p else 0
                )
            )
    assert {c.schedule for c in configs} == set(OURS) and len(configs) >= 13
    ref = unsplit_reference(CFG)
    for cfg, ranks in zip(configs, per_config(spawn(train_each, p, configs))):
        assert not isinstance(ranks[0], str), ranks[0]
        assert equals_reference(ranks, ref), cfg  # float64: rtol 1e-10, atol 1e-12
        schedule = make_schedule(cfg.schedule, p, cfg.micro_batches, cfg.stages_per_rank)
        assert [r.peak_in_flight for r in ranks] == peak_in_flight(schedule)  # held while running


class _ForgetsW(PipelineStep):
    """A runner that splits the backward and then skips the weights' half."""

    def _weight(self, action):
        self._release(action.stage, action.microbatch)


def _forgets_w(rt, cfg):
    return _ForgetsW(rt, cfg)


def test_a_lost_weight_gradient_is_caught():
    """Guard against a check that cannot fail: a W that never runs leaves the split stages' weight
    gradients at zero, and the comparison sees it."""
    cfg = CFG.replace(schedule="zb-h1", micro_batches=2, steps=1)
    (ranks,) = per_config(spawn(train_each, 2, [cfg], _forgets_w))
    assert not equals_reference(ranks, unsplit_reference(cfg))


TORCH = {
    "gpipe": 1,
    "1f1b": 1,
    "interleaved-1f1b": 2,
    "looped-bfs": 2,
    "zb-h1": 1,
    "interleaved-zb": 2,
    "zbv": 2,
    "dualpipev": 2,
}  # torch's seven (ScheduleInterleavedZeroBubble with v = 1 and 2)


def test_each_of_torchs_seven_schedules_equals_the_unsplit_model_and_runs_our_order():
    p, m = 2, 4
    cfg = CFG.replace(global_batch=16, micro_batches=m)  # torch needs equal micro-batches
    configs = [cfg.replace(schedule=name, stages_per_rank=v) for name, v in TORCH.items()]
    configs.append(cfg.replace(schedule="zbv", stages_per_rank=2, steps=1, scale_grads=False))
    results = per_config(spawn(train_each, p, configs, torch_step))
    ref = unsplit_reference(cfg)
    for config, ranks in zip(configs[:-1], results):
        assert not isinstance(ranks[0], str), ranks[0]
        assert equals_reference(ranks, ref), config.schedule
        if config.schedule != "dualpipev":  # the one of torch's that has no counterpart of ours
            assert [r.executed for r in ranks] == make_schedule(config.schedule, p, m, config.stages_per_rank)
    # scale_grads=False with a mean loss: M times the gradient, for the multi-stage schedules too.
    unscaled = merged(results[-1], "first_grads")
    one_step = unsplit_reference(cfg.replace(steps=1))
    assert all_ok(compare({n: m * g for n, g in one_step.first_grads.items()}, unscaled))


def test_the_lesson_passes_under_torchrun_and_reads_whole_at_80_columns(tmp_path):
    assert_lesson_passes_at_80_columns(
        "interleaved_zero_bubble", 2, "--emulate-ms", "0.5", "--json", str(tmp_path / "05.json")
    )
    report = json.loads((tmp_path / "05.json").read_text())
    assert report["passed"] and len(report["checks"]) >= 10
    assert report["figures"]["grids"]["zb-h1"]["bubble"] == pytest.approx(1 / 25)  # (P-1)/(3M+P-1), P=2, M=8


def test_flags_are_refused_in_one_line_naming_them():
    assert_flag_refused("interleaved_zero_bubble", "--stages-per-rank", "--stages-per-rank", "0")
    assert_flag_refused("interleaved_zero_bubble", "--micro-batches", "--micro-batches", "x")
