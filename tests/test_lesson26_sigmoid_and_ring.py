"""Lesson 26 runs under torchrun at P = 2 and 3: the closed form equals autograd, each hand ring (sigmoid,
InfoNCE in two passes) equals the library's and the whole batch, every {InfoNCE, sigmoid} x {gather, ring}
step equals the whole batch with its bytes equal to the formula, the ring's memory stays under a bound that
does not grow with P.

And open_clip's `SigLipLoss` recipe (`distlab.contrastive.siglip_recipe`, its `bidir` and `gather`
exchanges re-implemented with the same arithmetic) at P = 2 and 4 under DDP gives the same gradients as
plain autograd on the whole batch, and so does `distributed_backward` (gather and ring) on the same
model: the baseline the streamed sigmoid loss is measured against computes the same thing.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_flag_refused, assert_lesson_passes_at_80_columns, load_lesson
from streamed_helpers import STREAMED_N as N
from streamed_helpers import SigTowers, full_batch, local_rows
from torch.nn.parallel import DistributedDataParallel as DDP

from distlab.contrastive.siglip_recipe import siglip_recipe_loss
from distlab.processes.spawn import spawn
from distlab.proof.compare import all_ok, compare, grads_of
from distlab.proof.models import paired_data
from distributed_clip import distributed_backward

LESSON = "sigmoid_and_ring"


@pytest.mark.parametrize("world", [2, 3])
def test_lesson_passes(world, monkeypatch):
    if world == 2:  # in strict device mode: what a GPU would refuse (a model or batch left on the host) fails
        monkeypatch.setenv("DISTLAB_STRICT_DEVICE", "1")
    out = assert_lesson_passes_at_80_columns(
        LESSON, world, "--pairs-per-rank", "24", "--micro-batch-size", "10", "--memory-pairs", "128"
    )
    assert out.count("PASS ") == 16 and "Ring: block held" in out


def test_a_bad_flag_is_one_line():
    assert_flag_refused(LESSON, "--pairs-per-rank", "--pairs-per-rank", "0")


def _infonce_hand_ring(rt, merge_sums_as_they_are: bool):
    """The lesson's InfoNCE ring on this rank's 3 pairs against autograd on the whole batch; optionally
    with a wrong merge of the traveling column (m, l): the sums added without rescaling to one max."""
    lesson = load_lesson("sigmoid_and_ring")
    if merge_sums_as_they_are:
        lesson.merge_lse = lambda got, mine: [torch.maximum(got[0], mine[0]), got[1] + mine[1]]
    gen = torch.Generator().manual_seed(5)
    z = [F.normalize(torch.randn(3 * rt.world_size, 4, generator=gen, dtype=torch.float64), dim=1) for _ in "xy"]
    mine = slice(3 * rt.rank, 3 * rt.rank + 3)
    _, g_x, g_y, _ = lesson.infonce_ring_by_hand(rt, z[0][mine].contiguous(), z[1][mine].contiguous(), 10.0)
    leaves = [t.clone().requires_grad_() for t in z]
    lesson.infonce(*leaves, 10.0).backward()
    return all(torch.allclose(g, leaf.grad[mine], rtol=1e-10, atol=1e-14) for g, leaf in zip((g_x, g_y), leaves))


def test_the_infonce_hand_ring_is_exact_and_its_check_can_fail():
    assert spawn(_infonce_hand_ring, 3, False) == [True] * 3
    assert spawn(_infonce_hand_ring, 3, True) == [False] * 3


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
