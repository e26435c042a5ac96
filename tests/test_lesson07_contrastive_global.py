"""Lesson 07: global x global under DDP. The plain gather gives exactly 1/P of the full-batch
gradient (seed 003's CODE BLOCK 1); backward of P * L, or the sum-backward gather, give all of it."""

import pytest

from distlab.compare import all_ok, compare
from distlab.contrastive.ddp_steps import GLOBAL_METHODS, first_step_gradients
from distlab.contrastive.reference import full_batch_gradients
from distlab.models import TwoTower, paired_data
from distlab.runtime import spawn

N, TAU, SEED = 12, 0.1, 4  # N = 12 splits over 1, 2, 3 and 4 ranks


def _reference():
    return full_batch_gradients(TwoTower(seed=SEED), *paired_data(N, seed=SEED), TAU)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_global_x_global_gradients(world_size):
    per_rank = spawn(first_step_gradients, world_size, GLOBAL_METHODS, N, TAU, seed=SEED)
    ref_loss, ref_grads = _reference()
    for results in per_rank:  # DDP leaves every rank with the same gradients: check each
        for method, (loss, grads) in results.items():
            assert loss == pytest.approx(ref_loss, rel=1e-10, abs=1e-12), method
        plain = results["global_plain"][1]
        # float64: rtol 1e-10, atol 1e-12
        assert all_ok(compare({n: g / world_size for n, g in ref_grads.items()}, plain))
        assert all_ok(compare(ref_grads, results["global_plain_xP"][1]))
        assert all_ok(compare(ref_grads, results["global_sum"][1]))
        # The check can fail: with more than one rank the plain gather is not the full gradient.
        assert all_ok(compare(ref_grads, plain)) == (world_size == 1)
