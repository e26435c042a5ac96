"""The emulated device (lessons 02, 03, 05, 06) changes only the clock: every schedule and the
bucketed all-reduce still compute the unsplit model's gradients. No timing is asserted here."""

import torch
from helpers import equals_reference, load_lesson, per_config, train_each

from distlab.data_split.data_parallel.problem import DataParallelConfig, build, mean_loss, shard
from distlab.model_split.training import PipelineConfig, unsplit_reference
from distlab.processes.spawn import spawn
from distlab.proof import emulate
from distlab.proof.reference import one_process, sgd

CFG = PipelineConfig(
    widths=(6, *[8] * 8, 4), global_batch=13, steps=2, lr=0.2, seed=3, gather_spans=False, emulate_ms=0.2
)


def test_an_action_costs_one_unit_per_layer_and_an_unsplit_backward_two():
    assert [emulate.action_units(k, split, 3) for k, split in (("F", False), ("I", True), ("W", True))] == [3, 3, 3]
    assert emulate.action_units("I", False, 3) == 6


def test_every_schedule_on_the_emulated_device_equals_the_unsplit_model():
    configs = [
        CFG.replace(schedule=name, stages_per_rank=v, micro_batches=4)
        for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1), ("zbv", 2))
    ]
    ref = unsplit_reference(CFG)
    for cfg, ranks in zip(configs, per_config(spawn(train_each, 2, configs))):
        assert not isinstance(ranks[0], str), ranks[0]
        assert equals_reference(ranks, ref), cfg.schedule


DP = DataParallelConfig(global_batch=8, layers=3, width=8, steps=1, seed=5)


def _buckets_on_the_emulated_device(rt, overlap):
    """Lesson 06's buckets over the emulated link, with slow layers: the averaged gradients."""
    lesson = load_lesson("data_parallel")
    model, x, target = build(DP)
    emulate.slow_layers(model, emulate.EmulatedDevice(0.2))
    link = emulate.EmulatedLink(ms_per_mib=1.0)
    buckets = lesson.GradientBuckets(model, rt, 300, overlap=overlap, link=link)
    mean_loss(model(shard(x, rt)), shard(target, rt)).backward()
    buckets.wait()
    link.close()
    return {name: p.grad.clone() for name, p in model.named_parameters()}, len(buckets.buckets)


def test_buckets_over_the_emulated_link_equal_one_process():
    model, x, target = build(DP)
    ref = one_process(model, lambda k: (x, target), mean_loss, sgd(DP.lr), 1).first_grads
    for overlap in (True, False):
        for grads, count in spawn(_buckets_on_the_emulated_device, 2, overlap):
            assert count >= 2
            assert all(torch.allclose(grads[n], ref[n], rtol=1e-10, atol=1e-12) for n in ref)
