"""Lesson 15 runs under torchrun at P = 2 and 3: the closed form equals autograd, the hand ring equals the
library's and the whole batch, every {InfoNCE, sigmoid} x {gather, ring} step equals the whole batch
with its bytes equal to the formula, the ring's memory stays under a bound that does not grow with P.

And open_clip's `SigLipLoss` recipe (`distlab.contrastive.siglip_recipe`, its `bidir` and `gather`
exchanges re-implemented with the same arithmetic) at P = 2 and 4 under DDP gives the same gradients as
plain autograd on the whole batch, and so does `distributed_backward` (gather and ring) on the same
model: the baseline the streamed sigmoid loss is measured against computes the same thing.
"""

import copy

import pytest
from helpers import assert_flag_refused, assert_lesson_passes_at_80_columns
from streamed_helpers import STREAMED_N as N
from streamed_helpers import SigTowers, full_batch, local_rows
from torch.nn.parallel import DistributedDataParallel as DDP

from distlab.compare import all_ok, compare, grads_of
from distlab.contrastive.siglip_recipe import siglip_recipe_loss
from distlab.models import paired_data
from distlab.spawn import spawn
from distributed_clip import distributed_backward

LESSON = "15_sigmoid_and_ring.py"


@pytest.mark.parametrize("world", [2, 3])
def test_lesson_passes(world, monkeypatch):
    if world == 2:  # in strict device mode: what a GPU would refuse (a model or batch left on the host) fails
        monkeypatch.setenv("DISTLAB_STRICT_DEVICE", "1")
    out = assert_lesson_passes_at_80_columns(
        LESSON, world, "--pairs-per-rank", "24", "--micro-batch-size", "10", "--memory-pairs", "128"
    )
    assert out.count("PASS ") == 14 and "Ring: block held" in out


def test_a_bad_flag_is_one_line():
    assert_flag_refused(LESSON, "--pairs-per-rank", "--pairs-per-rank", "0")


def recipe_and_step(rt):
    """Per method, this rank's parameter gradients after one backward under DDP."""
    x, y = paired_data(N)
    rows, c = local_rows(rt), N // rt.world_size
    out = {}
    for variant in ("bidir", "gather"):
        model = SigTowers()
        ddp = DDP(model)  # kept alive through the backward: its hooks do the reduction
        z_x, z_y, s, b = ddp(x[rows], y[rows])
        siglip_recipe_loss(z_x, z_y, s, b, variant).backward()
        out[variant] = grads_of(model)
    for exchange in ("gather", "ring"):
        model = SigTowers()
        config = {"GLOBAL_BATCH_SIZE": N, "MICRO_BATCH_SIZE": c, "STREAM_CHUNK_SIZE": 5, "EXCHANGE": exchange}
        distributed_backward(DDP(model), x[rows], y[rows], config)
        out[f"streamed {exchange}"] = grads_of(model)
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_open_clip_siglip_recipe_and_the_streamed_step_equal_the_whole_batch(world):
    runs = spawn(recipe_and_step, world, timeout_s=120)
    model = copy.deepcopy(SigTowers())
    x, y = paired_data(N)
    full_batch(model, x, y, world, N).backward()
    ref = grads_of(model)
    for per_rank in runs:
        for method, grads in per_rank.items():
            assert all_ok(compare(ref, grads)), (world, method)
