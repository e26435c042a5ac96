"""Lesson 23: the sum-backward gather (the lesson's own all_reduce form, the library's reduce_scatter
form) and torch's own differentiable gather make local x global exact; the cost figures follow
their formulas."""

import pytest
import torch
from helpers import (
    assert_flag_refused,
    assert_gather_result,
    assert_lesson_passes_at_80_columns,
    gather_forward_and_backward,
    load_lesson,
    value_error,
)

from distlab.contrastive.batch import local_block
from distlab.contrastive.cost import global_logits, local_logits, loss_cost, ring_elements
from distlab.contrastive.reference import full_batch_gradients
from distlab.contrastive.step import ddp_step, first_step_gradients, wrap_ddp
from distlab.contrastive.variants import GLOBAL_SUM, LOCAL_SUM
from distlab.processes.identity import Runtime
from distlab.processes.spawn import spawn
from distlab.proof.compare import all_ok, compare
from distlab.proof.models import TwoTower, paired_data

N, TAU, SEED = 12, 0.1, 6
LESSON = "contrastive_allgather_fix"


def _fixes_first_step(rt):
    fixes = load_lesson(LESSON).FIXES  # the lesson's own gather is one of them
    return first_step_gradients(rt, fixes, N, TAU, seed=SEED)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_every_fix_gives_the_full_batch_gradient(world_size):
    per_rank = spawn(_fixes_first_step, world_size)
    ref_loss, ref_grads = full_batch_gradients(TwoTower(seed=SEED), *paired_data(N, seed=SEED), 1 / TAU)
    names = [v.name for v in load_lesson(LESSON).FIXES]
    for results in per_rank:
        assert list(results) == names
        for name in names:
            loss, grads = results[name]
            assert loss == pytest.approx(ref_loss, rel=1e-10, abs=1e-12), name
            assert all_ok(compare(ref_grads, grads)), name  # float64: rtol 1e-10, atol 1e-12


def _lesson_gather(rt):
    return gather_forward_and_backward(rt, load_lesson(LESSON).gather_all_reduce)


def test_the_lessons_gather_sums_the_gradient_over_ranks():
    for rank, (gathered, grad) in enumerate(spawn(_lesson_gather, 3)):
        assert_gather_result(rank, 3, gathered, grad, sums_over_ranks=True)


def _unequal_batches(rt):
    """Rank r gets C + r pairs: DDP runs the encoders happily; the loss must refuse on every rank."""
    x, y = paired_data(N, seed=SEED)
    rows = slice(0, 3 + rt.rank)
    return value_error(ddp_step, rt, wrap_ddp(TwoTower(seed=SEED), rt), x[rows], y[rows], TAU, LOCAL_SUM)


def test_unequal_local_batches_fail_on_every_rank():
    messages = spawn(_unequal_batches, 3, timeout_s=30)
    assert len(set(messages)) == 1 and messages[0] is not None and "equal local batches" in messages[0], messages


def test_a_global_batch_that_does_not_split_is_refused():
    four_ranks = Runtime(rank=0, world_size=4, local_rank=0, backend="gloo", device=torch.device("cpu"))
    with pytest.raises(ValueError, match="split evenly"):
        local_block(torch.zeros(10, 2), four_ranks)


def _cost(rt, n):
    gen = torch.Generator().manual_seed(rt.rank)
    z = [torch.nn.functional.normalize(torch.randn(n // rt.world_size, 4, generator=gen), dim=-1) for _ in range(2)]
    return {v.name: loss_cost(rt, *z, TAU, v, repeats=1) for v in (GLOBAL_SUM, LOCAL_SUM)}


def test_largest_tensor_is_n_by_n_globally_and_c_by_n_locally():
    n, p = 64, 2
    cost = spawn(_cost, p, n)[0]
    assert cost[GLOBAL_SUM.name]["largest_bytes"] == n * n * 4  # float32
    assert cost[LOCAL_SUM.name]["largest_bytes"] == n // p * n * 4


def test_cost_formulas():
    assert global_logits(8) == {"matmul": 64, "softmax": 128}
    assert local_logits(8, 4) == {"matmul": 2 * 2 * 8, "softmax": 2 * 2 * 8}
    ring = ring_elements(4, 8, 2)
    assert ring["all_reduce (backward)"] == 2 * ring["reduce_scatter (backward)"] == 2 * 3 / 4 * 16


def test_the_lesson_passes_and_reads_whole_at_80_columns():
    assert_lesson_passes_at_80_columns(
        LESSON, 2, "--global-batch", "48", "--cost-global-batch", "128", "--comm-global-batch", "256", "--comm-dim", "8"
    )


@pytest.mark.parametrize("flag, value", [("--cost-global-batch", "0"), ("--comm-dim", "x"), ("--tau", "inf")])
def test_bad_flags_are_refused_before_any_process_group(flag, value):
    assert_flag_refused(LESSON, flag, flag, value)
