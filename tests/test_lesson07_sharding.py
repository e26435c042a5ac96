"""Lesson 07: ZeRO-1/2/3 (the lesson's, the one implementation) and FSDP2 equal one process on the whole
batch (float64, AdamW with weight decay, 3 steps: every parameter, step 1's gradients, every AdamW state),
at P = 2, 3, 4 with uneven shards; what each rank holds and sends equals the formulas; a checkpoint
saved at P = 4 resumes at P = 2 equal to the uninterrupted run (1e-12) and at P = 4 bit-identical.
One spawn per P (3, 4) runs every strategy; the lesson itself runs under torchrun at P = 1 and 2, 80
columns, making the same claims against one process in its verdict (run_all.sh runs it at P = 4)."""

from __future__ import annotations

import shutil
import tempfile

import pytest
import torch
from helpers import assert_flag_refused, assert_lesson_passes_at_80_columns, load_lesson

from distlab.data_split.sharding import accounting
from distlab.data_split.sharding.dcp_resume import save_and_resume
from distlab.data_split.sharding.flat import units_of
from distlab.data_split.sharding.fsdp import Fsdp2, fsdp_held
from distlab.data_split.sharding.problem import ShardingConfig, build_model, reference
from distlab.data_split.sharding.replicated import Replicated
from distlab.data_split.sharding.training import run_strategy
from distlab.processes.spawn import spawn
from distlab.proof.compare import against, all_ok, compare

CFG = ShardingConfig()  # layers of Psi_u = 221, 154, 60 parameters: no P in 2..4 divides them all


def _sums_instead_of_averaging(model, rt, cfg):
    """The lesson's ZeRO-1 with the division by P undone: a sum of the ranks' gradients."""
    z = load_lesson("sharding").zero1(model, rt, cfg)
    average = z.after_backward

    def summed():
        average()
        for shard in z.shards:
            shard.grad.mul_(rt.world_size)

    z.after_backward = summed
    return z


def _everything(rt, checkpoint_dir):
    lesson = load_lesson("sharding")
    makes = {
        "DDP": Replicated,
        "FSDP2": Fsdp2,
        **{f"{stage} lesson": make for stage, make in lesson.BY_HAND.items()},
    }
    if rt.world_size == 3:
        makes["summed"] = _sums_instead_of_averaging
    out = {name: run_strategy(rt, CFG, make) for name, make in makes.items()}
    if checkpoint_dir is not None:
        out["resume"] = save_and_resume(rt, CFG, checkpoint_dir, CFG.steps, CFG.steps)
    return out


@pytest.fixture(scope="module")
def references():
    return {"steps": reference(CFG), "resumed": reference(CFG, 2 * CFG.steps)}


# P = 2 is the lesson's own run below (its verdict makes the same comparisons with one process).
@pytest.mark.parametrize("world_size", [3, 4])
def test_every_stage_and_fsdp2_equal_one_process_and_the_formulas(world_size, references):
    p = world_size
    units = units_of(build_model(CFG), 0, p)
    assert any(u.numel % p for u in units)  # uneven shards: the flat buffers are padded
    directory = tempfile.mkdtemp() if p == 4 else None
    try:
        per_rank = spawn(_everything, p, directory, timeout_s=240)
    finally:
        if directory:
            shutil.rmtree(directory)
    ref = references["steps"]
    assert ref.losses[-1] < ref.losses[0]  # it trains, so equal parameters mean something
    sizes = accounting.Sizes.of(units, p, 8)
    for rank, out in enumerate(per_rank):
        for name, run in out.items():
            if name in ("resume", "summed"):
                continue
            assert all_ok(against(ref, run).values()), (name, rank)  # params, grads, AdamW states, losses
            stage = name.split()[0]
            if stage == "FSDP2":
                assert run.held == fsdp_held(build_model(CFG), p, rank, 8), (rank, run.held)
                continue
            assert run.held == accounting.held(stage, sizes), (name, rank, run.held)
            assert run.live_bytes == sum(run.held.values()) - run.held["step counts"]
            assert run.sent == accounting.expected_bytes(stage, sizes, units[0].shard_numel), (name, rank)
        ddp, zero3 = out["DDP"].sent, out["ZeRO-3 lesson"].sent
        assert out["ZeRO-1 lesson"].sent == out["ZeRO-2 lesson"].sent == ddp == 2 * (p - 1) * sizes.shard * 8
        assert zero3 == 1.5 * ddp - (p - 1) * units[0].shard_numel * 8  # 1.5x DDP, less one gather
        # ZeRO-3 holds a P-th of DDP's model states (within the padding).
        assert sum(out["ZeRO-3 lesson"].held.values()) < sum(out["DDP"].held.values()) / p + 4 * 8 * len(units) + 16
        if "summed" in out:  # the check has teeth: Adam all but hides a P-times gradient in the
            summed = out["summed"]  # weights (m / sqrt(v) is scale-free but for eps), not in m, v
            assert not all_ok(against(ref, summed).values())
            assert all_ok(compare(ref.params, summed.params, rtol=0, atol=1e-5))
            assert all_ok(
                compare({n: p * g for n, g in ref.first_grads.items()}, summed.first_grads, rtol=1e-3, atol=0)
            )
        if "resume" in out:
            resume = out["resume"]
            assert all_ok(compare(references["resumed"].params, resume.uninterrupted))
            assert all(torch.equal(resume.uninterrupted[k], resume.same_p[k]) for k in resume.same_p)
            assert resume.other_ranks == 2
            if rank < 2:
                assert all_ok(compare(resume.uninterrupted, resume.other_p, rtol=0.0, atol=1e-12))
            else:
                assert resume.other_p is None


@pytest.mark.parametrize("world_size", [1, 2])
def test_the_lesson_passes_under_torchrun_at_80_columns(world_size):
    out = assert_lesson_passes_at_80_columns("sharding", world_size)
    assert "resumed at P = 1" in out and "0 (bit-identical)" in out


def test_bad_flags_are_one_line():
    assert_flag_refused("sharding", "--steps", "--steps", "0")
    assert_flag_refused("sharding", "--weight-decay", "--weight-decay", "-1")
