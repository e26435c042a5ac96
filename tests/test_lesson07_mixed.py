"""Lesson 07 under mixed precision (bf16 weights and gradients, a float32 master that AdamW steps, float32
moments): at P = 2, DDP and the lesson's ZeRO-1/2/3 hold per rank what `accounting.held` says at e = 2,
e_m = 4, item by item, send its bytes at e = 2, and train like one process under the same recipe written
out (`MasterStepped`, plain autograd) within the lesson's tolerance. The checks have teeth: a formula of the
wrong dtypes, a master of the wrong dtype (float64) and a sum in place of the mean are each rejected."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from helpers import load_lesson

from distlab.data_split.sharding import accounting
from distlab.data_split.sharding.flat import units_of
from distlab.data_split.sharding.problem import ShardingConfig, build_model, reference
from distlab.data_split.sharding.replicated import Replicated
from distlab.data_split.sharding.training import run_strategy
from distlab.processes.spawn import spawn
from distlab.proof.compare import against, all_ok

MIXED = ShardingConfig().mixed()
P = 2


def _summed_zero2(model, rt, cfg):
    """The lesson's ZeRO-2 with each shard's gradient a sum over the ranks, not their mean."""
    z = load_lesson("sharding").zero2(model, rt, cfg)

    def summed():  # after the reduce-scatters that backward ran, before the masters take the gradients
        for shard in z.shards:
            shard.grad.mul_(rt.world_size)

    z.after_backward = summed
    return z


def _mixed_runs(rt):
    lesson = load_lesson("sharding")
    out = {stage: run_strategy(rt, MIXED, make) for stage, make in {"DDP": Replicated, **lesson.BY_HAND}.items()}
    out["ZeRO-2 float64 master"] = run_strategy(rt, replace(MIXED, master=torch.float64), lesson.zero2)
    out["ZeRO-2 summed"] = run_strategy(rt, MIXED, _summed_zero2)
    return out


@pytest.fixture(scope="module")
def runs():
    return spawn(_mixed_runs, P, timeout_s=240)


def test_mixed_stages_hold_their_formula_and_equal_one_process(runs):
    lesson, ref = load_lesson("sharding"), reference(MIXED)
    assert ref.losses[-1] < ref.losses[0]  # it trains
    units = units_of(build_model(MIXED), 0, P)
    sizes = accounting.Sizes.of(units, P, 2, 4)
    for rank, out in enumerate(runs):
        for stage in accounting.STAGES:
            run, formula = out[stage], accounting.held(stage, sizes)
            assert run.held == formula, (stage, rank, run.held, formula)
            assert run.held["master copy"] == 4 * (sizes.psi if stage == "DDP" else sizes.shard)
            assert run.live_bytes == sum(run.held.values()) - run.held["step counts"], (stage, rank)
            assert run.sent == accounting.expected_bytes(stage, sizes, units[0].shard_numel), (stage, rank)
            assert all_ok(against(ref, run, lesson.RTOL_MIXED, lesson.ATOL_MIXED).values()), (stage, rank)
            # A formula of the wrong dtypes is rejected: one dtype at 2 or 4 bytes, or float64 throughout.
            for e, e_m in ((2, 2), (4, 4), (8, 8), (2, 8)):
                assert run.held != accounting.held(stage, accounting.Sizes.of(units, P, e, e_m)), (stage, e, e_m)


def test_a_wrong_master_dtype_and_a_sum_are_rejected(runs):
    lesson, ref = load_lesson("sharding"), reference(MIXED)
    units = units_of(build_model(MIXED), 0, P)
    for out in runs:
        wide = out["ZeRO-2 float64 master"]  # its master and moments are 8 bytes: not the recipe's
        assert wide.held != accounting.held("ZeRO-2", accounting.Sizes.of(units, P, 2, 4))
        assert wide.held == accounting.held("ZeRO-2", accounting.Sizes.of(units, P, 2, 8))
        summed = against(ref, out["ZeRO-2 summed"], lesson.RTOL_MIXED, lesson.ATOL_MIXED)
        assert not summed["gradients"].ok and not all_ok(summed.values())  # the tolerance is no wider than P x


def test_the_mixed_totals_are_the_lessons_per_psi_figures():
    # Psi = 1200 in 2 layers of 2 tensors, P = 2 dividing both: Psi_P = 600, no padding.
    s = accounting.Sizes(psi=1200, shard=600, tensors=4, units=2, world=2, e=2, e_m=4)
    totals = {stage: sum(accounting.held(stage, s).values()) for stage in accounting.STAGES}
    steps_ddp, steps = 4 * 4, 4 * 2
    assert totals == {
        "DDP": 16 * 1200 + steps_ddp,
        "ZeRO-1": 4 * 1200 + 16 * 600 + steps,
        "ZeRO-2": 2 * 1200 + 16 * 600 + steps,
        "ZeRO-3": 16 * 600 + steps,
    }
    one_dtype = accounting.Sizes(1200, 600, 4, 2, 2, 8)
    assert "master copy" not in accounting.held("ZeRO-2", one_dtype) and one_dtype.e_m == 8
