"""Lesson 15: MX by hand (blocks of 32 along the inner dimension, an e8m0 power-of-two scale each, by RCEIL or FLOOR)
equals torchao's own cast under either rule, at float32 and bf16, with a NaN block (the byte 255), an inf, a zero
block, a subnormal and amax 500 (RCEIL 2^1, FLOOR 2^0), and its MXFP8Linear with emulated kernels bit for bit (Y,
dX, dW, in the model's dtype) under either rule at float32 and bf16; RCEIL's check rejects a FLOOR scale; the FP8
all-gather with the amax agreed first equals one process casting the whole weight bit for bit at P = 1-4 and sends
(P-1)(Psi_P + 4) bytes per rank, counted by CollectiveWatch, while casting with each shard's own amax does not; a
block that does not divide the width is one line naming the flag on every rank."""

import logging
import math
from argparse import Namespace

import pytest
import torch
from helpers import assert_lesson_passes_at_80_columns, assert_same_error_on_every_rank, load_lesson

from distlab.processes.spawn import spawn

for _noisy in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_noisy).setLevel(logging.ERROR)

from torchao.prototype.moe_training.mxfp8_linear import MXFP8Linear  # noqa: E402
from torchao.prototype.mx_formats.config import ScaleCalculationMode  # noqa: E402
from torchao.prototype.mx_formats.mx_tensor import to_mx  # noqa: E402
from torchao.quantization.quantize_.common.kernel_preference import KernelPreference  # noqa: E402

E4M3 = torch.float8_e4m3fn


@pytest.fixture(scope="module")
def lesson():
    return load_lesson("mxfp8_sharding")


def _data(seed, rows=32, width=96, outliers=True):
    t = torch.randn(rows, width, generator=torch.Generator().manual_seed(seed))
    if outliers:
        t[:, 1] *= 1e4
        t[3, 32:64] = 0.0  # a block of zeros: its scale is the smallest, its values stay 0
    return t


@pytest.mark.parametrize("seed", [0, 1])
def test_mx_cast_equals_torchaos_rceil_cast(lesson, seed):
    t = _data(seed)
    ours_q, ours_e = lesson.mx_cast(t, 32)
    theirs_e, theirs_q = to_mx(t, E4M3, 32, ScaleCalculationMode.RCEIL)
    assert torch.equal(ours_q.view(torch.uint8), theirs_q.view(torch.uint8))
    assert torch.equal(ours_e.flatten(), theirs_e.view(torch.uint8).flatten())


def _floor_cast(t, block, rule=None):
    """The wrong scale: OCP's FLOOR rule, 2^(floor(log2 amax) - 8), which may saturate the block's largest."""
    blocks = t.float().reshape(*t.shape[:-1], t.shape[-1] // block, block)
    x = torch.floor(torch.log2(blocks.abs().amax(-1, keepdim=True))) - 8
    return (blocks / torch.exp2(x)).clamp(-448, 448).to(E4M3).reshape(t.shape), (x + 127).to(torch.uint8)


def test_the_check_fails_with_the_floor_rule(lesson):
    t = _data(0)
    theirs_e, theirs_q = to_mx(t, E4M3, 32, ScaleCalculationMode.RCEIL)
    q, e = _floor_cast(t, 32)
    assert not torch.equal(e.flatten(), theirs_e.view(torch.uint8).flatten())
    assert not torch.equal(q.view(torch.uint8), theirs_q.view(torch.uint8))


def _mx_layer_pair(lesson, cast=None):
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(32, 64, generator=gen)
    weight = torch.randn(32, 64, generator=gen)
    dy = torch.randn(32, 32, generator=gen)
    theirs = MXFP8Linear(64, 32, bias=False, kernel_preference=KernelPreference.EMULATED)
    theirs.weight.data.copy_(weight)
    xt, xo, wo = x.clone().requires_grad_(), x.clone().requires_grad_(), weight.clone().requires_grad_()
    yt = theirs(xt)
    yt.backward(dy)
    right = lesson.mx_cast
    if cast is not None:
        lesson.mx_cast = cast
    try:
        yo = lesson.MXLinear.apply(xo, wo, 32)
        yo.backward(dy)
    finally:
        lesson.mx_cast = right
    return [yt.detach(), xt.grad, theirs.weight.grad], [yo.detach(), xo.grad, wo.grad]


def test_mx_linear_equals_torchaos_mxfp8_linear_bit_for_bit(lesson):
    theirs, ours = _mx_layer_pair(lesson)
    assert all(torch.equal(a, b) for a, b in zip(theirs, ours))


def test_the_layer_check_fails_with_the_floor_rule(lesson):
    theirs, ours = _mx_layer_pair(lesson, _floor_cast)
    assert not any(torch.equal(a, b) for a, b in zip(theirs, ours))


def _special(dtype):
    """Blocks of 32 holding a NaN, an inf, only zeros, amax 500 exactly, a float32 subnormal; 6 x 64."""
    t = _data(2, rows=6, width=64, outliers=False) * torch.logspace(-30, 20, 6)[:, None]
    t[0, 3], t[1, 40], t[2, :32], t[4, 5] = torch.nan, torch.inf, 0.0, 1e-42
    t[3, :32] = torch.linspace(-500.0, 500.0, 32)
    return t.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rule", ["rceil", "floor"])
def test_mx_cast_equals_torchao_under_either_rule_on_special_blocks(lesson, rule, dtype):
    t = _special(dtype)
    mode = ScaleCalculationMode.FLOOR if rule == "floor" else ScaleCalculationMode.RCEIL
    theirs_e, theirs_q = to_mx(t, E4M3, 32, mode)
    q, e = lesson.mx_cast(t, 32, rule)
    assert torch.equal(q.view(torch.uint8), theirs_q.view(torch.uint8))
    assert torch.equal(e.flatten(), theirs_e.view(torch.uint8).flatten())
    assert e[0, 0, 0] == 255 and lesson.mx_dequantize(q, e, 32)[0, :32].isnan().all()  # a NaN block is all NaN
    assert e[3, 0, 0] == {"rceil": 128, "floor": 127}[rule]  # amax 500: 2^1 against 2^0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rule", ["rceil", "floor"])
def test_mx_linear_equals_torchao_in_the_models_dtype(lesson, rule, dtype):
    gen = torch.Generator().manual_seed(7)
    x, weight, dy = (torch.randn(*shape, generator=gen).to(dtype) for shape in ((32, 64), (32, 64), (32, 32)))
    runs = lesson.mx_linear_runs(x, weight, dy, rule)
    for name, theirs in runs["torchao"].items():
        assert theirs.dtype == dtype and torch.equal(runs["by hand"][name], theirs), name


def _whole_cast(flat):
    rho = (448.0 / flat.abs().max().double()).float()
    return (flat * rho).clamp(-448, 448).to(E4M3)


def _gathers(rt):
    """The lesson's gather, then the mistake, on this rank: {local_amax: (gathered bytes, bytes sent)}."""
    return {local: _gather(rt, local) for local in (False, True)}


def _gather(rt, local_amax: bool):
    from distlab.comm.watch import CollectiveWatch

    lesson = load_lesson("mxfp8_sharding")
    weight = torch.randn(7, 9, generator=torch.Generator().manual_seed(3))  # Psi = 63: uneven shards at P = 2, 4
    weight[rt.world_size - 1] *= 10.0
    shard = lesson.shard_of(weight.flatten(), rt.rank, rt.world_size)
    with CollectiveWatch({"world": torch.distributed.group.WORLD}) as watch:
        if local_amax:  # the mistake: each rank's own amax, no agreement
            out = torch.empty(rt.world_size * shard.numel(), dtype=torch.uint8)
            torch.distributed.all_gather_single(out, _whole_cast(shard).view(torch.uint8))
            gathered = out.view(E4M3)
        else:
            gathered, _ = lesson.fp8_all_gather(shard, E4M3)
    return gathered.view(torch.uint8), watch.ledgers["world"].sent


@pytest.fixture(scope="module")
def gathers():
    """P = 1-3 here (P = 4: test_the_lesson_passes, whose run checks the same two claims)."""
    every = {p: spawn(_gathers, p) for p in (1, 2, 3)}
    return {(p, local): [rank[local] for rank in ranks] for p, ranks in every.items() for local in (False, True)}


@pytest.mark.parametrize("world", [1, 2, 3])
def test_fp8_all_gather_equals_one_process_casting_the_whole_weight(lesson, gathers, world):
    weight = torch.randn(7, 9, generator=torch.Generator().manual_seed(3))
    weight[world - 1] *= 10.0
    one = _whole_cast(weight.flatten()).view(torch.uint8)
    psi_p = math.ceil(63 / world)
    for gathered, sent in gathers[world, False]:
        assert torch.equal(gathered[:63], one)
        assert sent == lesson.gather_bytes(psi_p, world, 1, 4) == (world - 1) * (psi_p + 4)


@pytest.mark.parametrize("world", [2, 3])
def test_the_check_fails_when_each_shard_keeps_its_own_amax(gathers, world):
    weight = torch.randn(7, 9, generator=torch.Generator().manual_seed(3))
    weight[world - 1] *= 10.0
    one = _whole_cast(weight.flatten()).view(torch.uint8)
    assert not all(torch.equal(gathered[:63], one) for gathered, _ in gathers[world, True])


def _check(rt, width):
    load_lesson("mxfp8_sharding").world_rules(Namespace(width=width, rows=64, out_width=64, block=32), rt.world_size)


def test_a_block_that_does_not_divide_the_width_is_one_line_on_every_rank(lesson):
    message = assert_same_error_on_every_rank(_check, 2, 100, match="--width")
    assert message == "--width: a block of 32 must divide --width = 100", message
    with pytest.raises(ValueError) as typed:  # the flag the user changed is the one at fault
        load_lesson("mxfp8_sharding").world_rules(Namespace(width=128, rows=64, out_width=64, block=7), 2)
    assert str(typed.value) == "--block: a block of 7 must divide --width = 128", typed.value


def test_the_lesson_passes():
    out = assert_lesson_passes_at_80_columns("mxfp8_sharding", 4)
    assert "FP8 + amax (counted)" in out and "MX, blocks of 32" in out
