"""Lesson 14: the by-hand FP8 linear layer (amax, scale, saturated cast, _scaled_mm; e4m3 forward, e5m2 output
gradient) equals torchao's Float8Linear bit for bit (Y, dX, dW, and a short training's every loss); each matmul's
error, tensorwise and rowwise, lies inside the bound stated before it runs, on well-scaled inputs and on inputs
with outliers and underflow; each check fails on a wrong answer (the output gradient cast to e4m3, the scale not
inverted, a bound that assumes two more mantissa bits); the layer equals torchao's for a bf16 model too (Y in
bf16); the rowwise matmuls with power-of-two scales and dY in e4m3 equal torchao's ROWWISE recipe bit for bit for
a bf16 model, and for a float32 one once rounded through bf16 as torchao's are; the cost model's break-even
size is where the FP8 step costs what the bf16 one does; a format torch or its CPU kernel lacks is one line."""

import argparse
import copy

import pytest
import torch
from helpers import assert_flag_refused, assert_lesson_passes_at_80_columns, load_lesson
from torchao.float8 import Float8LinearConfig, convert_to_float8_training
from torchao.float8.config import Float8LinearRecipeName

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


@pytest.fixture(scope="module")
def lesson():
    return load_lesson("fp8_linear")


def _inputs(seed: int, rows=24, width=40, out=16, outliers=False):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=gen)
    weight = torch.randn(out, width, generator=gen) / width**0.5
    dy = torch.randn(rows, out, generator=gen)
    if outliers:  # a few channels 1,000 times larger: the rest of X sinks towards e4m3's subnormals
        x[:, :3] *= 1000.0
        dy[::5] *= 1e-4
    return x, weight, dy


def _run(layer, x, dy):
    xi = x.clone().requires_grad_()
    y = layer(xi)
    y.backward(dy)
    return [y.detach(), xi.grad, layer.weight.grad]


def _both(lesson, fwd, grad, seed=0, outliers=False):
    x, weight, dy = _inputs(seed, outliers=outliers)
    plain = torch.nn.Linear(x.shape[1], weight.shape[0], bias=False)
    plain.weight.data.copy_(weight)
    return _run(lesson.to_fp8(plain, fwd, grad), x, dy), _run(lesson.torchao_twin(plain, fwd, grad), x, dy)


@pytest.mark.parametrize("formats", [(E4M3, E5M2), (E4M3, E4M3), (E5M2, E5M2)], ids=["e4m3-e5m2", "e4m3", "e5m2"])
@pytest.mark.parametrize("outliers", [False, True])
def test_by_hand_equals_torchao_bit_for_bit(lesson, formats, outliers):
    ours, theirs = _both(lesson, *formats, outliers=outliers)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_by_hand_equals_torchao_in_the_models_dtype(lesson, dtype):
    """A bf16 model: torchao computes Y in float32 and returns it in bf16; so does the by-hand layer."""
    x, weight, dy = (t.to(dtype) for t in _inputs(4))
    plain = torch.nn.Linear(x.shape[1], weight.shape[0], bias=False, dtype=dtype)
    plain.weight.data.copy_(weight)
    ours, theirs = _run(lesson.to_fp8(plain, E4M3, E5M2), x, dy), _run(lesson.torchao_twin(plain, E4M3, E5M2), x, dy)
    assert all(a.dtype == b.dtype == dtype and torch.equal(a, b) for a, b in zip(ours, theirs))


def _rowwise_recipe(lesson, x, weight, dy, power_of_two=True):
    """torchao's ROWWISE recipe, and the lesson's rowwise matmuls with dY in e4m3 and (by default) power-of-two
    scales."""
    config = Float8LinearConfig.from_recipe_name(Float8LinearRecipeName.ROWWISE)
    plain = torch.nn.Linear(x.shape[1], weight.shape[0], bias=False, dtype=x.dtype)
    plain.weight.data.copy_(weight)
    theirs = _run(convert_to_float8_training(plain, config=config), x, dy)
    mm = [(x, weight.t(), True), (dy, weight, False), (dy.t(), x, False)]  # fast accumulation for Y, as torchao
    ours = [lesson.fp8_matmul(a.float(), b.float(), E4M3, E4M3, True, f, power_of_two).to(x.dtype) for a, b, f in mm]
    return ours, theirs


def test_rowwise_equals_torchaos_rowwise_recipe_for_a_bf16_model(lesson):
    data = [t.to(torch.bfloat16) for t in _inputs(5, rows=32, width=64, out=48)]
    ours, theirs = _rowwise_recipe(lesson, *data)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    ours, theirs = _rowwise_recipe(lesson, *data, power_of_two=False)  # float32 scales: not the recipe
    assert not any(torch.equal(a, b) for a, b in zip(ours, theirs))


def test_rowwise_against_torchaos_rowwise_recipe_for_a_float32_model(lesson):
    """The difference the lesson states and its cause: torchao's rowwise products come back through bf16 (its
    workaround for `_scaled_mm`'s missing float32 output), a few thousandths of the largest entry away from the
    float32 products; the float32 products rounded to bf16 and back equal torchao's bit for bit."""
    ours, theirs = _rowwise_recipe(lesson, *_inputs(5, rows=32, width=64, out=48))
    gaps = [((a - b).abs().max() / b.abs().max()).item() for a, b in zip(ours, theirs)]
    assert 0 < max(gaps) <= 2**-8, gaps  # within bf16's rounding of the entries
    assert all(torch.equal(a.bfloat16().float(), b) for a, b in zip(ours, theirs))


def test_the_check_fails_with_the_gradient_in_the_forward_format(lesson):
    """dY cast to e4m3 where torchao uses e5m2: the same forward, different gradients."""
    x, weight, dy = _inputs(1)
    plain = torch.nn.Linear(x.shape[1], weight.shape[0], bias=False)
    plain.weight.data.copy_(weight)
    ours = _run(lesson.to_fp8(plain, E4M3, E4M3), x, dy)
    theirs = _run(lesson.torchao_twin(plain, E4M3, E5M2), x, dy)
    assert torch.equal(ours[0], theirs[0])
    assert not torch.equal(ours[1], theirs[1]) and not torch.equal(ours[2], theirs[2])


def test_the_check_fails_when_the_scale_is_not_inverted(lesson, monkeypatch):
    x, weight, dy = _inputs(2)
    right = lesson.fp8_matmul(x, weight.t(), E4M3, E4M3)
    monkeypatch.setattr(torch.Tensor, "reciprocal", lambda t: t)  # _scaled_mm given s, not 1/s
    assert not torch.allclose(lesson.fp8_matmul(x, weight.t(), E4M3, E4M3), right, rtol=0.5)


def test_convert_to_float8_training_returns_a_new_module_for_a_bare_linear(lesson):
    """A bare nn.Linear cannot be swapped in place: the converted module is what convert returns."""
    plain = torch.nn.Linear(8, 8)
    converted = lesson.torchao_twin(plain, E4M3, E5M2)
    assert type(plain) is torch.nn.Linear and type(converted).__name__ == "Float8Linear"
    nested = torch.nn.Sequential(copy.deepcopy(plain))
    assert type(lesson.torchao_twin(nested, E4M3, E5M2)[0]).__name__ == "Float8Linear"


def _fractions(lesson, seed, outliers):
    x, weight, dy = _inputs(seed, outliers=outliers)
    matmuls = [(x, weight.t(), E4M3, E4M3), (dy, weight, E5M2, E4M3), (dy.t(), x, E5M2, E4M3)]
    out = []
    for rowwise in (False, True):
        for a, b, fa, fb in matmuls:
            bound = lesson.error_bound(a, b, fa, fb, rowwise)
            err = (lesson.fp8_matmul(a, b, fa, fb, rowwise).double() - a.double() @ b.double()).abs()
            out.append((err / bound).max().item())
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("outliers", [False, True])
def test_every_matmul_lies_inside_its_bound(lesson, seed, outliers):
    assert max(_fractions(lesson, seed, outliers)) <= 1.0


def test_the_bound_check_fails_for_a_bound_with_two_more_mantissa_bits(lesson, monkeypatch):
    monkeypatch.setattr(lesson, "unit_roundoff", lambda fmt: torch.finfo(fmt).eps / 8)
    assert max(_fractions(lesson, 0, False)) > 1.0


def test_the_rowwise_scales_are_one_per_row_along_k(lesson):
    x, weight, _ = _inputs(3)
    q, scale = lesson.quantize(x, E4M3, rowwise=True)
    assert scale.shape == (x.shape[0], 1)
    assert torch.equal(q.float().abs().amax(1), torch.full((x.shape[0],), 448.0))  # every row reaches max_f


def test_the_break_even_size_is_where_fp8_costs_what_bf16_does(lesson):
    device = lesson.DEVICES["h100"]
    d = lesson.break_even(device, 8192)
    cost = lesson.gemm_times(device, d, 8192)
    assert cost["fp8"] + cost["casts"] == pytest.approx(cost["bf16"], rel=1e-9)
    below, above = (lesson.gemm_times(device, d * f, 8192) for f in (0.5, 2))
    assert below["fp8"] + below["casts"] > below["bf16"] and above["fp8"] + above["casts"] < above["bf16"]


def test_a_format_torch_or_its_cpu_kernel_lacks_is_one_line(lesson):
    assert lesson.fp8_format("e5m2") is E5M2
    with pytest.raises(argparse.ArgumentTypeError, match="torch has no such format"):
        lesson.fp8_format("e3m4")
    with pytest.raises(argparse.ArgumentTypeError, match="CPU _scaled_mm does not take it"):
        lesson.fp8_format("e4m3fnuz")
    assert_flag_refused("fp8_linear", "--forward-format", "--forward-format", "e3m4")


def test_the_lesson_passes():
    out = assert_lesson_passes_at_80_columns("fp8_linear", 1, "--steps", "4", "--rows", "32")
    assert "max err/bound" in out and "fp8 - f32" in out and "FP8 pays" in out
