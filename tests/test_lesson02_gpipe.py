"""Lesson 02: GPipe over M micro-batches, with and without activation checkpointing, trains exactly
like the unsplit model on the whole batch; forgetting the micro-batch scale would not."""

import pytest
from helpers import assert_lesson_passes_at_80_columns, equals_reference, load_lesson, merged, per_config, train_each

from distlab.model_split.training import PipelineConfig, unsplit_reference
from distlab.processes.spawn import spawn
from distlab.proof.compare import all_ok, compare

# 16 layers: 8 or 4 per stage, so K = 2 checkpoint segments of 4 or 2 layers really recompute
# (a one-layer segment of this MLP saves and recomputes nothing; see probe.py). N = 13 rows:
# uneven micro-batches for every M > 1.
CFG = PipelineConfig(widths=(6, *[8] * 15, 4), global_batch=13, steps=3, lr=0.2, seed=3, probe=True, gather_spans=False)


def matrix(schedule: str, world_size: int) -> dict:
    """Every (M, K) of the matrix equals the unsplit model; returns the per-rank runs by (M, K)."""
    ms = sorted({1, world_size - 1, world_size, 2 * world_size + 1})
    configs = {
        (m, k): CFG.replace(schedule=schedule, micro_batches=m, checkpoint_segments=k) for m in ms for k in (0, 2)
    }
    results = per_config(spawn(train_each, world_size, list(configs.values())))
    ref = unsplit_reference(CFG)
    assert ref.losses[-1] < ref.losses[0]  # it trains, so equal parameters mean something
    runs = dict(zip(configs, results))
    for config, ranks in runs.items():
        assert equals_reference(ranks, ref), config  # float64: rtol 1e-10, atol 1e-12
    for m in ms:  # checkpointing did something: fewer bytes held, more layer forwards
        plain, ckpt = runs[m, 0], runs[m, 2]
        assert all(c.saved_peak_bytes < p.saved_peak_bytes for p, c in zip(plain, ckpt))
        assert all(c.layer_forwards > p.layer_forwards for p, c in zip(plain, ckpt))
    return runs


@pytest.mark.parametrize("world_size", [2, 4])
def test_gpipe_equals_the_unsplit_model_and_holds_all_m_microbatches(world_size):
    for (m, _), ranks in matrix("gpipe", world_size).items():
        assert [r.peak_in_flight for r in ranks] == [m] * world_size  # measured while running


def test_forgetting_the_microbatch_scale_gives_m_times_the_gradient():
    """The bug a loss curve hides: backward on each micro-batch mean as it is sums M means. The
    comparison catches it, and the factor is exactly M for even micro-batches."""
    cfg = CFG.replace(global_batch=12, micro_batches=4, steps=1)
    (runs,) = per_config(spawn(train_each, 2, [cfg.replace(scale_loss=False)]))
    ref = unsplit_reference(cfg)
    assert not all_ok(compare(ref.first_grads, merged(runs, "first_grads")))
    assert all_ok(compare({n: 4 * g for n, g in ref.first_grads.items()}, merged(runs, "first_grads")))


def test_bad_input_fails_identically_on_every_rank_before_any_message():
    cases = {
        "at least one micro-batch (--micro-batches)": CFG.replace(micro_batches=0),
        "every micro-batch needs at least one row": CFG.replace(micro_batches=CFG.global_batch + 1),
        "K = 1 would checkpoint nothing": CFG.replace(micro_batches=2, checkpoint_segments=1),
        "more stages than layers": CFG.replace(widths=(6, 5, 4), micro_batches=2),  # 2 layers, 3 ranks
        "does not fit the model": CFG.replace(micro_batches=2, input_features=7),
        "takes v in [1] stages per rank": CFG.replace(micro_batches=2, stages_per_rank=2),
    }
    for ranks, phrase in zip(per_config(spawn(train_each, 3, list(cases.values()))), cases):
        assert len(set(ranks)) == 1 and phrase in ranks[0], ranks


def test_flags_are_validated_before_any_process_starts(capsys):
    lesson = load_lesson("gpipe_checkpoint")
    for argv, flag in (
        (["--micro-batches", "0"], "--micro-batches"),
        (["--checkpoint-segments", "-1"], "--checkpoint-segments"),
        (["--width", "0"], "--width"),
    ):
        with pytest.raises(SystemExit):
            lesson.parse_args(argv)
        assert flag in capsys.readouterr().err
    with pytest.raises(SystemExit):
        lesson.parse_args(["--help"])
    assert "M, from 1 to N (default: 8)" in " ".join(capsys.readouterr().out.split())


def _claim(ratios, can_save):
    return load_lesson("gpipe_checkpoint").memory_claim({"ratios": ratios, "can_save": can_save}, 2)


def test_the_memory_claim_says_only_what_was_measured():
    text, ok = _claim([0.63, 0.63], [True, True])
    assert ok and "0.63x" in text
    text, ok = _claim([1.0, 1.0], [False, False])  # one-layer segments: no cut, and no claim of one
    assert ok and "save nothing" in text and "cuts" not in text
    assert not _claim([1.0, 0.6], [True, True])[1]  # a stage that should have saved and did not


def test_the_lesson_passes_at_p_1():
    """One GPU allows only P = 1: one stage, no bubble, and the emulated idle share has no ratio to print."""
    out = assert_lesson_passes_at_80_columns(
        "gpipe_checkpoint", 1, "--width", "32", "--global-batch", "64", "--emulate-ms", "1"
    )
    assert "P = 1: one stage, no bubble" in out
