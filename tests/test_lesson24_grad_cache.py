"""Lesson 24: GradCache under DDP on P = 2 ranks gives the single-process global batch's gradients,
with one reducing backward per model and step under no_sync_except_last; its memory follows B.

The reference runs in the parent process (`full_batch_gradients` with `as_ranks`): a deep copy, plain
autograd, one loss over the global batch. Rank r's micro-batches run with a graph from rank r's seed, in
GradCache's order (tower x's micro-batches, then tower y's), so dropout draws the masks each rank drew. Float64: rtol
1e-10, atol 1e-12.
"""

import contextlib
import copy
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from helpers import (
    assert_flag_refused,
    assert_lesson_passes_at_80_columns,
    assert_same_error_on_every_rank,
    load_lesson,
)
from torch.nn.parallel import DistributedDataParallel as DDP

from distlab.contrastive.gather import gather_with_grad
from distlab.contrastive.grad_cache import GradCache
from distlab.contrastive.losses import clip_loss, local_clip_loss
from distlab.contrastive.reference import RankStreams, as_ranks, full_batch_gradients
from distlab.data_split.data_parallel.ddp import HookCalls, counting
from distlab.pieces.chunks import chunks
from distlab.processes.spawn import spawn
from distlab.proof.compare import all_ok, compare, grads_of
from distlab.proof.memory import PeakMemory
from distlab.proof.models import TwoTower, paired_data

P, N, B, TAU, SEED = 2, 22, 4, 0.1, 11  # C = 11 pairs per rank in micro-batches of 4, 4, 3
C = N // P
LESSON = "grad_cache"


def rep_clip_loss(rep_x, rep_y, tau=TAU):
    return clip_loss(F.normalize(rep_x, dim=-1), F.normalize(rep_y, dim=-1), 1 / tau)


def ddp_rep_clip_loss(rep_x, rep_y, offset, tau=TAU):
    z_x, z_y = F.normalize(rep_x, dim=-1), F.normalize(rep_y, dim=-1)
    return local_clip_loss(z_x, z_y, gather_with_grad(z_x), gather_with_grad(z_y), 1 / tau, offset)


def model(shared=False):
    """Two towers, or one tower that encodes both sides (encoder_y is encoder_x)."""
    two_tower = TwoTower(dim_x=12, dim_y=12, hidden=24, dropout=0.3, seed=5)
    if shared:
        two_tower.encoder_y = two_tower.encoder_x
    return two_tower


def data():
    return paired_data(N, dim_x=12, dim_y=12, seed=6)


def mine(rt, x, y):
    return x[rt.rank * C : (rt.rank + 1) * C], y[rt.rank * C : (rt.rank + 1) * C]


def _ddp_grad_cache(rt, shared):
    names = ("encoder_x", "encoder_x") if shared else ("encoder_x", "encoder_y")
    source = model(shared)
    wrapped = {name: DDP(copy.deepcopy(source.get_submodule(name))) for name in names}  # one per module
    counter = HookCalls()
    for m in wrapped.values():
        counting(m, counter)  # one counter for both towers
    results = {}
    for sync_last in (True, False):
        for m in wrapped.values():
            m.zero_grad(set_to_none=True)
        counter.calls = 0
        torch.manual_seed(SEED + rt.rank)
        loss = GradCache([wrapped[n] for n in names], B, ddp_rep_clip_loss)(
            *mine(rt, *data()), offset=rt.rank * C, no_sync_except_last=sync_last
        )
        grads = {k: v for name, m in wrapped.items() for k, v in grads_of(m.module, f"{name}.").items()}
        results[sync_last] = (grads, counter.calls, loss.item())
    return results


def global_reference(shared):
    forward = as_ranks(RankStreams([SEED + r for r in range(P)]), chunks(C, B), tower_by_tower=True)
    return full_batch_gradients(model(shared), *data(), 1 / TAU, forward=forward)


@pytest.mark.parametrize("shared", [False, True], ids=["two towers", "one shared tower"])
def test_ddp_grad_cache_equals_the_global_batch_with_one_all_reduce(shared):
    per_rank = spawn(_ddp_grad_cache, P, shared)
    ref_loss, ref_grads = global_reference(shared)
    chunks = -(-C // B)  # 3
    distinct = 1 if shared else 2
    for sync_last, all_reduces in ((True, distinct), (False, 2 * chunks)):
        for grads, count, _ in (r[sync_last] for r in per_rank):
            assert all_ok(compare(ref_grads, grads))  # every rank holds the global gradient
            assert count == all_reduces  # one bucket per tower: one call per reducing backward
        mean_loss = sum(r[sync_last][2] for r in per_rank) / P
        assert abs(mean_loss - ref_loss) < 1e-10 * abs(ref_loss)


def test_the_ddp_check_would_catch_rank_local_negatives():
    """Guard: a per-rank loss (each rank's own C x C logits, no gather, as a DDP run of single-process
    GradCache code computes) differs from the global batch, so the comparison above can fail."""
    per_rank = spawn(_ddp_local_only, P)
    _, ref_grads = global_reference(False)
    assert not all_ok(compare(ref_grads, per_rank[0]))


def _ddp_local_only(rt):
    source = model()
    models = [DDP(copy.deepcopy(source.encoder_x)), DDP(copy.deepcopy(source.encoder_y))]
    torch.manual_seed(SEED + rt.rank)
    GradCache(models, B, rep_clip_loss)(*mine(rt, *data()), no_sync_except_last=True)
    return {**grads_of(models[0].module, "encoder_x."), **grads_of(models[1].module, "encoder_y.")}


def _no_sync_without_ddp(rt):
    source = model()
    GradCache([DDP(source.encoder_x), source.encoder_y], B, partial(ddp_rep_clip_loss, offset=rt.rank * C))(
        *data(), no_sync_except_last=True
    )


def test_no_sync_except_last_on_a_plain_model_fails_on_every_rank():
    assert_same_error_on_every_rank(_no_sync_without_ddp, P, match="model(s) [1] are not")


def test_memory_follows_the_micro_batch_not_the_batch():
    """PeakMemory of one step: GradCache at B = 8 needs a fraction of plain autograd's peak at a batch
    of 128, and its peak hardly grows from 64 to 128 pairs while plain autograd's doubles. (Measured:
    plain 3.6 -> 7.1 MiB, GradCache 0.64 -> 0.66 MiB.)"""
    two_tower = TwoTower(hidden=1024, dropout=0.1, seed=1)

    def peak(n, b=None):
        x, y = paired_data(n, seed=2)
        two_tower.zero_grad(set_to_none=True)
        with PeakMemory() as mem:
            if b is None:
                rep_clip_loss(two_tower.encoder_x(x), two_tower.encoder_y(y)).backward()
            else:
                GradCache([two_tower.encoder_x, two_tower.encoder_y], b, rep_clip_loss)(x, y)
        return mem.peak_bytes

    plain_64, plain_128 = peak(64), peak(128)
    cache_64, cache_128 = peak(64, 8), peak(128, 8)
    assert cache_128 < plain_128 / 4
    assert plain_128 - plain_64 > 5 * (cache_128 - cache_64)


def test_the_lessons_own_three_steps_equal_the_full_batch_and_need_the_replay(monkeypatch):
    """`grad_cache_step`, the mechanism written out in the lesson: exact with dropout on, and wrong
    when its random states are not replayed (so the comparison can fail)."""
    lesson = load_lesson(LESSON)
    for replay, expect_ok in ((True, True), (False, False)):
        if not replay:  # a RandContext that restores nothing: the recompute draws fresh masks
            monkeypatch.setattr(lesson, "RandContext", lambda *inputs: contextlib.nullcontext())
        two_tower, (x, y) = model(), data()
        forward = as_ranks(RankStreams([SEED]), chunks(N, B), tower_by_tower=True)
        ref_loss, ref_grads = full_batch_gradients(two_tower, x, y, 1 / TAU, forward=forward)
        torch.manual_seed(SEED)
        loss = lesson.grad_cache_step([two_tower.encoder_x, two_tower.encoder_y], (x, y), B, rep_clip_loss)
        assert all_ok(compare(ref_grads, grads_of(two_tower))) == expect_ok
        assert abs(loss.item() - ref_loss) < 1e-10 * abs(ref_loss)  # the loss is right either way


def test_the_lesson_passes_at_p_3_and_reads_whole_at_80_columns():
    """P = 3 with N = 96 (C = 32): towers wide enough that activations outweigh the parameter
    gradients, so every claim, the memory ones included, holds."""
    assert_lesson_passes_at_80_columns(
        LESSON, 3, "--global-batch", "96", "--micro-batch-size", "8", "--width", "512", "--repeats", "1"
    )


@pytest.mark.parametrize("flag, value", [("--micro-batch-size", "0"), ("--dropout", "1"), ("--tau", "nan")])
def test_bad_flags_are_refused_in_one_line_before_any_process_group(flag, value):
    assert_flag_refused(LESSON, flag, flag, value)


def test_a_micro_batch_larger_than_the_batch_is_refused():
    assert_flag_refused(LESSON, "--micro-batch-size", "--micro-batch-size", "1000")
