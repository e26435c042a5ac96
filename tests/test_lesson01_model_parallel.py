"""Lesson 01: layers split across P ranks with the lesson's own send/recv chain train exactly like
the unsplit model, one rank computing at a time."""

import pytest
from helpers import assert_flag_refused, equals_reference, load_lesson, per_config, train_each

from distlab.model_split.training import PipelineConfig, unsplit_reference
from distlab.processes.spawn import SpawnError, spawn
from distlab.proof.timeline import max_concurrency

CFG = PipelineConfig(widths=(6, 10, 12, 10, 8, 4), global_batch=16, steps=4, lr=0.2, seed=3)  # 5 layers


def _lesson_step(rt, cfg):
    return load_lesson("model_parallel").ModelParallelStep(rt, cfg)


def _train(rt, cfgs):
    return train_each(rt, cfgs, _lesson_step)


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_gradients_and_parameters_equal_the_unsplit_model(world_size):
    runs, shorter = per_config(spawn(_train, world_size, [CFG, CFG.replace(steps=CFG.steps - 1)]))
    ref = unsplit_reference(CFG)
    assert equals_reference(runs, ref)  # float64: rtol 1e-10, atol 1e-12
    assert ref.losses[-1] < ref.losses[0]  # it trains, so matching parameters mean something
    assert max_concurrency(runs[0].spans) == 1
    # The check can fail: one step less is visibly different.
    assert not equals_reference(shorter, ref)


def test_bad_input_fails_identically_on_every_rank():
    cases = [CFG.replace(widths=(6, 5, 4)), CFG.replace(input_features=7)]  # 2 layers on 3 ranks; 7 features
    messages = per_config(spawn(_train, 3, cases))
    for ranks, phrase in zip(messages, ["more stages than layers", "does not fit the model: stage 0"]):
        assert len(set(ranks)) == 1 and phrase in ranks[0]


def test_an_unhandled_error_names_its_rank():
    with pytest.raises(SpawnError, match="rank .* failed"):
        spawn(_lesson_step, 2, CFG.replace(widths=(6, 4)))  # one layer, two ranks: stage_bounds raises


@pytest.mark.parametrize("argv", [("--width", "0"), ("--global-batch", "-1"), ("--input-features", "x")])
def test_bad_flags_are_one_line_naming_the_flag(argv):
    assert_flag_refused("model_parallel", argv[0], *argv)
