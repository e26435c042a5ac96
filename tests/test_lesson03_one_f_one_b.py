"""Lesson 03: the lesson's own 1F1B loop is the library's, trains exactly like the unsplit model,
and holds at most min(M, P - r) micro-batches on rank r, measured while it runs."""

import pytest
from helpers import assert_lesson_passes_at_80_columns, equals_reference, load_lesson, per_config, train_each

from distlab.model_split import schedules
from distlab.model_split.runner import PipelineStep
from distlab.model_split.training import PipelineConfig, microbatch_sizes, unsplit_reference
from distlab.processes.spawn import spawn

CFG = PipelineConfig(
    widths=(6, *[8] * 15, 4), global_batch=13, steps=3, lr=0.2, seed=3, probe=True, gather_spans=False
)  # as lesson 02's test: 16 layers, uneven micro-batches


def _lesson_loop(rt, cfg):
    """Our runner executing the 1F1B loop written in the lesson."""
    return PipelineStep(rt, cfg, load_lesson("one_f_one_b").one_f_one_b(rt.world_size, cfg.micro_batches))


def _train(rt, cfgs):
    return train_each(rt, cfgs, _lesson_loop)


def test_the_lessons_loop_is_the_librarys_one_f_one_b():
    loop = load_lesson("one_f_one_b").one_f_one_b
    for p in range(1, 7):
        for m in range(1, 14):
            assert loop(p, m) == schedules.one_f_one_b(p, m), (p, m)


@pytest.mark.parametrize("world_size", [2, 4])
def test_one_f_one_b_equals_the_unsplit_model_with_at_most_p_minus_r_in_flight(world_size):
    ms = sorted({1, world_size - 1, world_size, 2 * world_size + 1})
    configs = [CFG.replace(micro_batches=m, checkpoint_segments=k) for m in ms for k in (0, 2)]
    ref = unsplit_reference(CFG)
    for cfg, ranks in zip(configs, per_config(spawn(_train, world_size, configs))):
        assert equals_reference(ranks, ref), cfg  # float64: rtol 1e-10, atol 1e-12
        m = cfg.micro_batches
        assert [r.peak_in_flight for r in ranks] == [min(m, world_size - r) for r in range(world_size)]


def test_saved_activation_bytes_follow_the_rows_in_flight():
    """GPipe holds every row of the batch at its peak; 1F1B only the rows of the micro-batches in
    flight. The measured bytes (saved_tensors_hooks) scale exactly with those rows."""
    p, m = 4, 9
    cfg = CFG.replace(micro_batches=m, steps=1)
    gpipe_runs, ofob_runs = per_config(spawn(train_each, p, [cfg, cfg.replace(schedule="1f1b")]))
    sizes = microbatch_sizes(CFG.global_batch, m)  # 2, 2, 2, 2, 1, 1, 1, 1, 1
    for r, (gpipe_run, ofob_run) in enumerate(zip(gpipe_runs, ofob_runs)):
        rows = peak_rows = 0
        for action in schedules.one_f_one_b(p, m)[r]:
            rows += sizes[action.microbatch] * (1 if action.kind == "F" else -1)
            peak_rows = max(peak_rows, rows)
        assert ofob_run.saved_peak_bytes * CFG.global_batch == gpipe_run.saved_peak_bytes * peak_rows
        assert ofob_run.saved_peak_bytes < gpipe_run.saved_peak_bytes


def test_the_lesson_passes_at_p_1():
    """One GPU allows only P = 1: one stage, no bubble, and the emulated idle share has no ratio to print."""
    out = assert_lesson_passes_at_80_columns(
        "one_f_one_b", 1, "--width", "32", "--global-batch", "64", "--emulate-ms", "1"
    )
    assert "P = 1: one stage, no bubble" in out
