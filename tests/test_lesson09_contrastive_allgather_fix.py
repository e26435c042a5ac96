"""Lesson 09: the sum-backward gather (all_reduce and reduce_scatter forms) and torch's own
differentiable gather make local x global exact; the cost figures follow their formulas."""

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from distlab.compare import all_ok, compare
from distlab.contrastive.cost import logits_per_rank, loss_cost, ring_elements
from distlab.contrastive.ddp_steps import ddp_step, first_step_gradients, local_block
from distlab.contrastive.reference import full_batch_gradients
from distlab.models import TwoTower, paired_data
from distlab.runtime import spawn

N, TAU, SEED = 12, 0.1, 6
FIXES = ("local_all_reduce", "local_reduce_scatter", "local_library")


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_every_fix_gives_the_full_batch_gradient(world_size):
    per_rank = spawn(first_step_gradients, world_size, FIXES, N, TAU, seed=SEED)
    ref_loss, ref_grads = full_batch_gradients(TwoTower(seed=SEED), *paired_data(N, seed=SEED), TAU)
    for results in per_rank:
        for method in FIXES:
            loss, grads = results[method]
            assert loss == pytest.approx(ref_loss, rel=1e-10, abs=1e-12), method
            assert all_ok(compare(ref_grads, grads)), method  # float64: rtol 1e-10, atol 1e-12


def _unequal_batches(rt):
    """Rank r gets C + r pairs: DDP runs the encoders happily; the loss must refuse on every rank."""
    x, y = paired_data(N, seed=SEED)
    rows = slice(0, 3 + rt.rank)
    try:
        ddp_step(DistributedDataParallel(TwoTower(seed=SEED)), x[rows], y[rows], TAU, "local_reduce_scatter")
        return "no error"
    except ValueError as err:
        return f"ValueError: {err}"


def test_unequal_local_batches_fail_on_every_rank():
    messages = spawn(_unequal_batches, 3, timeout_s=30)
    assert len(set(messages)) == 1 and "equal local batches" in messages[0], messages


def test_a_global_batch_that_does_not_split_is_refused():
    with pytest.raises(ValueError, match="split evenly"):
        local_block(torch.zeros(10, 2), 0, 4)


def _cost(rt, n):
    gen = torch.Generator().manual_seed(rt.rank)
    z = [torch.nn.functional.normalize(torch.randn(n // rt.world_size, 4, generator=gen), dim=-1) for _ in range(2)]
    return {m: loss_cost(*z, TAU, m, repeats=1) for m in ("global_sum", "local_reduce_scatter")}


def test_largest_tensor_is_n_by_n_globally_and_c_by_n_locally():
    n, p = 64, 2
    cost = spawn(_cost, p, n)[0]
    assert cost["global_sum"]["largest_bytes"] == n * n * 4  # float32
    assert cost["local_reduce_scatter"]["largest_bytes"] == n // p * n * 4


def test_cost_formulas():
    assert logits_per_rank(8, 4, "global") == {"matmul": 64, "softmax": 128}
    assert logits_per_rank(8, 4, "local") == {"matmul": 2 * 2 * 8, "softmax": 2 * 2 * 8}
    ring = ring_elements(4, 8, 2)
    assert ring["all_reduce (backward)"] == 2 * ring["reduce_scatter (backward)"] == 2 * 3 / 4 * 16
