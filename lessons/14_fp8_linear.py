"""Lesson 14: FP8 linear layers. A linear layer's three matmuls run on 8-bit floats: each operand is scaled
into the format's range, cast with saturation, multiplied by `torch._scaled_mm`, and the product unscaled.

    torchrun --nproc-per-node 1 lessons/14_fp8_linear.py     # splits no work: every rank would repeat it

The formats (OCP FP8, https://www.opencompute.org/documents/ocp-8-bit-floating-point-specification-ofp8):
e4m3 (4 exponent bits, 3 mantissa bits, max 448, unit roundoff u = 2^-4) carries the forward's X and W;
e5m2 (max 57344, u = 2^-3) has the range the output gradient dY needs. The cast of a tensor T to format f:

    amax = max |T|                 (tensorwise: one number; rowwise: one per row, along the inner dimension n)
    rho  = max_f / amax            (float32; T rho fills the format's range without overflowing it)
    T_q  = cast_f(clamp(T rho, -max_f, max_f))      (round to nearest, saturated: never inf)
    A B  ~ _scaled_mm(A_q, B_q, 1/rho_A, 1/rho_B)   = (A_q B_q) / (rho_A rho_B), accumulated in float32

A linear layer Y = X W^T runs three of them: Y = X W^T (X, W in e4m3), dX = dY W and dW = dY^T X (dY in
e5m2). Dynamic scaling (here, and the only kind torchao 0.18 implements) takes amax from the tensor being
cast; delayed scaling (Transformer Engine's older recipe) takes it from a history of earlier steps, saving a
pass over the tensor at the risk of saturating when the values grow.

The error of one matmul is bounded before it runs. Casting with unit roundoff u_A and underflow lambda_A (half the
format's subnormal spacing, divided by rho_A) gives |A_q/rho_A - A| <= u_A |A| + lambda_A elementwise; the product
of two such operands is off by at most ((1 + u_A)(1 + u_B) - 1) |A||B| = (u_A + u_B + u_A u_B) |A||B| (two
relative errors multiplied; with one format, (2u + u^2) |X||W|^T: Higham, Accuracy and Stability of Numerical
Algorithms, 2nd ed., ch. 3) plus the underflow terms; float32 accumulation of n exact FP8 products and the two
unscaling multiplications add theta_(n+2) |A_q/rho_A||B_q/rho_B|, with Higham's theta_m = m u_32 / (1 - m u_32),
u_32 = 2^-24. The lesson prints the measured error as a fraction of that bound. A training run has no such bound:
its trajectory is measured against float32 and shown as measured.

The library practitioners use is torchao (`convert_to_float8_training`); the by-hand layer equals its
Float8Linear bit for bit: forward, input gradient and weight gradient, and every step of a short training, for a
float32 and a bf16 model (Y in the model's dtype, as torchao returns it). The rowwise scales here are float32, as
torchao's axiswise cast; its ROWWISE recipe rounds them down to a power of two (`power_of_two`) and casts dY to
e4m3: with both, the three rowwise matmuls equal its layer bit for bit for a bf16 model. For a float32 model
torchao's rowwise products pass through bf16 (torch's `_scaled_mm` has no float32 output for rowwise scales, so
torchao asks for bf16 and casts back), a few thousandths of the largest entry away from the float32 products
here; rounded to bf16 and back, these equal its layer bit for bit too (tests).
"""

from __future__ import annotations

import argparse
import copy
import logging

import torch
import torch.nn.functional as F

for _noisy in ("torchao", "torch.utils._pytree"):  # torchao's import warns of CUDA kernels a CPU cannot load
    logging.getLogger(_noisy).setLevel(logging.ERROR)

from torchao.float8 import CastConfig, Float8LinearConfig, convert_to_float8_training  # noqa: E402

from distlab.processes.console import print0, rows_table  # noqa: E402
from distlab.processes.flags import positive_float, positive_int  # noqa: E402
from distlab.processes.runtime import distributed, run_main  # noqa: E402
from distlab.proof.cli import lesson_parser  # noqa: E402
from distlab.proof.compare import all_ok, compare, comparison_table  # noqa: E402
from distlab.proof.hardware import DEVICES  # noqa: E402
from distlab.proof.verdict import Verdict  # noqa: E402

FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}  # the two torch's CPU _scaled_mm takes
U32 = 2.0**-24  # float32's unit roundoff
EPS = 1e-12  # amax floor (torchao's): an all-zero tensor gets a finite scale


def fp8_format(name: str) -> torch.dtype:
    """A format's name (e4m3, e5m2) to its torch dtype; anything else is one line saying what torch has."""
    if name in FORMATS:
        return FORMATS[name]
    have = [n.removeprefix("float8_") for n in dir(torch) if n.startswith("float8_")]
    why = "its CPU _scaled_mm does not take it" if f"float8_{name}" in dir(torch) else "torch has no such format"
    raise argparse.ArgumentTypeError(
        f"{name}: {why} (torch {torch.__version__} has {', '.join(have)}; use e4m3 or e5m2)"
    )


def unit_roundoff(fmt: torch.dtype) -> float:
    """u = 2^-(mantissa bits + 1): half the spacing of the numbers in [1, 2)."""
    return torch.finfo(fmt).eps / 2


def underflow(fmt: torch.dtype) -> float:
    """Half the spacing of the subnormals: the absolute error of a cast near zero (in the scaled domain)."""
    return torch.finfo(fmt).tiny * torch.finfo(fmt).eps / 2


# ---- the mechanism: amax, scale, saturated cast, scaled matmul -------------------------------------------


def amax_of(t: torch.Tensor, rowwise: bool) -> torch.Tensor:
    """max |t| over the whole tensor, or over each row (the matmul's inner dimension n runs along a row)."""
    return t.abs().amax(dim=-1, keepdim=True) if rowwise else t.abs().max()


def scale_of(amax: torch.Tensor, fmt: torch.dtype, power_of_two: bool = False) -> torch.Tensor:
    """rho = max_f / amax, computed in float64 and stored in float32 (as torchao does, so eager and compiled
    code agree on the division); `power_of_two`: rounded down to 2^floor(log2 rho) (torchao's rowwise recipe)."""
    rho = (torch.finfo(fmt).max / amax.double().clamp(min=EPS)).float()
    return torch.exp2(torch.floor(torch.log2(rho))) if power_of_two else rho


def saturated_cast(t: torch.Tensor, scale: torch.Tensor, fmt: torch.dtype) -> torch.Tensor:
    """cast_f(clamp(t rho)): an element that rounds past max_f becomes max_f, never inf."""
    top = torch.finfo(fmt).max
    return (t.float() * scale).clamp(-top, top).to(fmt)


def quantize(t: torch.Tensor, fmt: torch.dtype, rowwise: bool = False, power_of_two: bool = False):
    """(t_q, rho): t in format fmt, t ~ t_q / rho."""
    scale = scale_of(amax_of(t, rowwise), fmt, power_of_two)
    return saturated_cast(t, scale, fmt), scale


def fp8_matmul(a, b, a_fmt, b_fmt, rowwise: bool = False, fast_accum: bool = False, power_of_two: bool = False):
    """a @ b (float32, rows x n @ n x cols) with both operands cast to FP8: rowwise scales run along n, one per
    row of a and one per column of b. _scaled_mm wants b column-major and multiplies by the inverse scales."""
    a_q, a_scale = quantize(a, a_fmt, rowwise, power_of_two)
    bt_q, b_scale = quantize(b.t(), b_fmt, rowwise, power_of_two)  # b's columns are b.t()'s rows
    return torch._scaled_mm(
        a_q.contiguous(),
        bt_q.contiguous().t(),  # column-major n x cols
        scale_a=a_scale.reciprocal(),
        scale_b=b_scale.reciprocal().t() if rowwise else b_scale.reciprocal(),
        out_dtype=torch.float32,
        use_fast_accum=fast_accum,
    )


class FP8Linear(torch.autograd.Function):
    """Y = X W^T with X, W in the forward format; dX = dY W and dW = dY^T X with dY in the gradient format.
    Each matmul casts its own operands (dynamic, tensorwise): the high-precision X and W are saved."""

    @staticmethod
    def forward(ctx, x, weight, fwd_fmt, grad_fmt):
        ctx.save_for_backward(x, weight)
        ctx.formats = fwd_fmt, grad_fmt
        rows = x.reshape(-1, x.shape[-1])
        y = fp8_matmul(rows, weight.t(), fwd_fmt, fwd_fmt, fast_accum=True)  # torchao's choice for Y
        return y.reshape(*x.shape[:-1], weight.shape[0]).to(x.dtype)  # in the model's dtype, as torchao

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        fwd_fmt, grad_fmt = ctx.formats
        dy_rows, x_rows = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])
        dx = fp8_matmul(dy_rows, weight, grad_fmt, fwd_fmt)
        dw = fp8_matmul(dy_rows.t(), x_rows, grad_fmt, fwd_fmt)
        return dx.reshape(x.shape), dw, None, None


class FP8LinearModule(torch.nn.Linear):
    """nn.Linear whose matmuls run through FP8Linear (the bias added in float32)."""

    formats = (torch.float8_e4m3fn, torch.float8_e5m2)

    def forward(self, x):
        y = FP8Linear.apply(x, self.weight, *self.formats)
        return y if self.bias is None else y + self.bias


def to_fp8(model: torch.nn.Module, fwd_fmt, grad_fmt) -> torch.nn.Module:
    """A deep copy of model with every nn.Linear turned into FP8LinearModule (same weights)."""
    twin = copy.deepcopy(model)
    for module in twin.modules():
        if type(module) is torch.nn.Linear:
            module.__class__ = FP8LinearModule
            module.formats = (fwd_fmt, grad_fmt)
    return twin


def torchao_twin(model: torch.nn.Module, fwd_fmt, grad_fmt) -> torch.nn.Module:
    """torchao's Float8Linear in place of every nn.Linear of a deep copy (its default: dynamic tensorwise
    scaling; our formats; the casts for the backward's matmuls follow the forward's). convert_to_float8_training
    swaps submodules in place and returns the root; a bare nn.Linear cannot be swapped in place, so then it
    returns a new Float8Linear: always use what it returns."""
    config = Float8LinearConfig(
        cast_config_input=CastConfig(target_dtype=fwd_fmt),
        cast_config_weight=CastConfig(target_dtype=fwd_fmt),
        cast_config_grad_output=CastConfig(target_dtype=grad_fmt),
    )
    return convert_to_float8_training(copy.deepcopy(model), config=config)


# ---- the a-priori bound of one matmul ------------------------------------------------------------------


def error_bound(a, b, a_fmt, b_fmt, rowwise: bool = False) -> torch.Tensor:
    """Elementwise bound on |fp8_matmul(a, b) - a b| (the docstring's formula), float64. It reads only a, b
    and the formats: the scales are recomputed from amax, nothing from the product."""
    a64, b64 = a.double().abs(), b.double().abs()
    ua = unit_roundoff(a_fmt) + 3 * U32  # the cast, plus float32's roundings of t rho and of 1/rho
    ub = unit_roundoff(b_fmt) + 3 * U32
    lam_a = underflow(a_fmt) / scale_of(amax_of(a, rowwise), a_fmt).double() * (1 + U32)  # unscaled underflow
    lam_b = underflow(b_fmt) / scale_of(amax_of(b.t(), rowwise), b_fmt).double().t() * (1 + U32)
    n = a.shape[1]
    cast = (ua + ub + ua * ub) * (a64 @ b64)
    cast += (1 + ua) * a64.sum(1, keepdim=True) * lam_b + (1 + ub) * lam_a * b64.sum(0, keepdim=True)
    cast += n * lam_a * lam_b
    theta = (n + 2) * U32 / (1 - (n + 2) * U32)
    accumulate = theta * (((1 + ua) * a64 + lam_a) @ ((1 + ub) * b64 + lam_b))
    return cast + accumulate


# ---- the chapter, part by part --------------------------------------------------------------------------


def name_of(fmt: torch.dtype) -> str:
    return next(name for name, known in FORMATS.items() if known == fmt)


def show_formats(args, verdict: Verdict) -> None:
    print0("\n[bold]1. The formats, one cast by hand, and what _scaled_mm computes[/]")
    rows = []
    for name, fmt in FORMATS.items():
        info = torch.finfo(fmt)
        rows.append((name, f"{info.max:g}", f"{info.tiny:.3g}", f"2^{int(torch.tensor(unit_roundoff(fmt)).log2())}"))
    print0(rows_table("", ("format", "max", "smallest normal", "u"), rows))
    x = torch.tensor([0.3, -1000.0, 1e-4])
    q, rho = quantize(x, FORMATS["e4m3"])
    print0(f"x = {x.tolist()}: amax {amax_of(x, False).item():g}, rho = 448/amax = {rho.item():.4g},", highlight=False)
    print0(f"x rho cast to e4m3 = {q.float().tolist()}, back: {(q.float() / rho).tolist()}", highlight=False)
    gen = torch.Generator().manual_seed(args.seed + 3)
    a_q, b_q = (torch.randn(n, args.width, generator=gen).mul(8).to(args.forward_format) for n in (args.rows, 8))
    one = torch.ones((), device=args.place)
    a_q, b_q = a_q.to(args.place), b_q.to(args.place)
    got = torch._scaled_mm(a_q, b_q.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
    verdict.check(
        "_scaled_mm at unit scales = float32 matmul of the upcast operands",
        torch.equal(got, a_q.float() @ b_q.float().t()),
    )
    print0(
        "At unit scales _scaled_mm is the float32 matmul of the upcast operands; with scales, the CPU's oneDNN kernel "
        "applies them inside its kernel: float32 roundings away from (A_q B_q) / (rho_A rho_B), inside part 3's bound.",
        highlight=False,
    )


def layer_inputs(args, generator: torch.Generator):
    """X, W (scaled so Y has unit-size entries) and an upstream dY, drawn on the CPU, moved to the device."""
    x = torch.randn(args.rows, args.width, generator=generator)
    weight = torch.randn(args.out_width, args.width, generator=generator) / args.width**0.5
    dy = torch.randn(args.rows, args.out_width, generator=generator)
    return x.to(args.place), weight.to(args.place), dy.to(args.place)


def show_equal_to_torchao(args, verdict: Verdict) -> None:
    print0("\n[bold]2. The by-hand layer against torchao's Float8Linear, bit for bit[/]")
    x, weight, dy = layer_inputs(args, torch.Generator().manual_seed(args.seed))
    results = {}
    for who, make in (("by hand", to_fp8), ("torchao", torchao_twin)):
        plain = torch.nn.Linear(args.width, args.out_width, bias=False, device=args.place)
        plain.weight.data.copy_(weight)
        layer = make(plain, args.forward_format, args.grad_format)
        xi = x.clone().requires_grad_()
        y = layer(xi)
        y.backward(dy)
        results[who] = {"Y": y.detach(), "dX": xi.grad, "dW": layer.weight.grad}
    rows = compare(results["torchao"], results["by hand"], rtol=0.0, atol=0.0)
    print0(comparison_table(rows, f"X {args.rows} x {args.width}, W {args.out_width} x {args.width}, float32"))
    verdict.check("by hand = torchao Float8Linear: Y, dX, dW bit for bit", all_ok(rows))


def show_bounds(args, verdict: Verdict) -> dict:
    print0("\n[bold]3. Each matmul's error against its bound, stated before the run[/]")
    x, weight, dy = layer_inputs(args, torch.Generator().manual_seed(args.seed + 1))
    fwd, grad = args.forward_format, args.grad_format
    matmuls = {"Y = X W^T": (x, weight.t(), fwd, fwd), "dX = dY W": (dy, weight, grad, fwd)}
    matmuls["dW = dY^T X"] = (dy.t(), x, grad, fwd)
    rows, fractions = [], {}
    for scaling in ("tensorwise", "rowwise"):
        for name, (a, b, fa, fb) in matmuls.items():
            bound = error_bound(a, b, fa, fb, scaling == "rowwise")  # first the bound, then the run
            err = (fp8_matmul(a, b, fa, fb, scaling == "rowwise").double() - a.double() @ b.double()).abs()
            fraction = (err / bound).max().item()
            fractions[f"{scaling} {name}"] = fraction
            rows.append((scaling, name, f"{err.max().item():.3g}", f"{bound.max().item():.3g}", f"{fraction:.3f}"))
    print0(rows_table("", ("scaling", "matmul", "max |err|", "max bound", "max err/bound"), rows))
    print0("err/bound is taken element by element; a fraction above 1 would break the bound.", highlight=False)
    verdict.check("every matmul's error inside its a-priori bound", max(fractions.values()) <= 1.0)
    return verdict.figure("bound_fraction", fractions)


def train(model: torch.nn.Module, args, data) -> list[float]:
    """SGD on the mean squared error, full batch; the loss of every step."""
    inputs, targets = data
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    losses = []
    for _ in range(args.steps):
        opt.zero_grad()
        loss = F.mse_loss(model(inputs), targets)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def show_training(args, verdict: Verdict) -> None:
    print0("\n[bold]4. A few training steps: FP8 against float32 (measured, not bounded)[/]")
    gen = torch.Generator().manual_seed(args.seed + 2)
    torch.manual_seed(args.seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(args.width, 4 * args.width), torch.nn.ReLU(), torch.nn.Linear(4 * args.width, args.out_width)
    )
    inputs = torch.randn(args.rows, args.width, generator=gen)
    targets = torch.sin(inputs @ torch.randn(args.width, args.out_width, generator=gen))  # a smooth teacher
    model, inputs, targets = model.to(args.place), inputs.to(args.place), targets.to(args.place)
    fwd, grad = args.forward_format, args.grad_format
    runs = {"float32": train(copy.deepcopy(model), args, (inputs, targets))}
    runs["fp8 by hand"] = train(to_fp8(model, fwd, grad), args, (inputs, targets))
    runs["torchao"] = train(torchao_twin(model, fwd, grad), args, (inputs, targets))
    shown = sorted({0, args.steps // 4, args.steps // 2, args.steps - 1})
    rows = [
        (str(t + 1), *(f"{runs[k][t]:.5f}" for k in runs), f"{runs['fp8 by hand'][t] - runs['float32'][t]:+.1e}")
        for t in shown
    ]
    print0(rows_table("", ("step", *runs, "fp8 - f32"), rows))
    verdict.check("by hand = torchao over every training step, bit for bit", runs["fp8 by hand"] == runs["torchao"])
    verdict.figure("losses", runs)


def gemm_times(device, d: int, rows: int) -> dict:
    """One linear layer's step (Y, dX, dW: 3 x 2 rows d d FLOPs) at bf16 and at FP8 peak, and the casts
    FP8 adds: each of the 6 operand casts reads its bf16 tensor twice (amax, cast) and writes 1 byte."""
    flops = 3 * 2 * rows * d * d
    cast_elements = 2 * (rows * d + d * d + rows * d)  # X, W, dY, each cast for two matmuls
    cast = 5 * cast_elements / device.bandwidth
    return {"bf16": flops / device.peak["bf16"], "fp8": flops / device.peak["fp8"], "casts": cast}


def show_cost(args) -> dict:
    print0("\n[bold]5. When FP8 pays: the cost model's peaks and the casts[/]")
    device = DEVICES[args.cost_device]
    peaks = f"bf16 {device.peak['bf16'] / 1e12:,.0f}, fp8 {device.peak['fp8'] / 1e12:,.0f} TFLOP/s dense"
    print0(
        f"{device.name}: {peaks}, {device.bandwidth / 1e12:.2f} TB/s ({device.source.split(':')[0]})", highlight=False
    )
    rows, table = [], {}
    for d in (256, 512, 1024, 2048, 4096, 8192, 16384):
        t = gemm_times(device, d, args.cost_rows)
        speedup = t["bf16"] / (t["fp8"] + t["casts"])
        table[d] = {**t, "speedup": speedup}
        rows.append((f"{d:,}", *(f"{t[k] * 1e6:.1f}" for k in ("bf16", "fp8", "casts")), f"{speedup:.2f}x"))
    print0(f"one layer's step, d x d weight, {args.cost_rows:,} rows; times in us at peak", highlight=False)
    print0(rows_table("", ("d", "bf16 GEMMs", "fp8 GEMMs", "casts", "bf16 / fp8"), rows))
    even = break_even(device, args.cost_rows)
    print0(
        "FP8 pays where 6 rows d^2 (1/bf16 - 1/fp8) > 5 x 2 (2 rows d + d^2) / bandwidth: from d = "
        f"{even:,.0f} at {args.cost_rows:,} rows. Below it the casts cost more than the faster matmul saves "
        "(casts unfused here; torch.compile fuses the amax into the kernel that produced the tensor).",
        highlight=False,
    )
    return {"device": device.name, "break_even_d": even, "table": table}


def break_even(device, rows: int) -> float:
    """The d where gemm_times' fp8 GEMMs + casts take as long as the bf16 GEMMs: the root of
    6 R d^2 g = 10 (2 R d + d^2) / bw, g = 1/bf16 - 1/fp8 (inf if FP8 never pays at this R)."""
    g, per_byte = 1 / device.peak["bf16"] - 1 / device.peak["fp8"], 1 / device.bandwidth
    slope = 6 * rows * g - 10 * per_byte
    return 20 * rows * per_byte / slope if slope > 0 else float("inf")


def parse_args():
    parser = lesson_parser(__doc__)
    parser.add_argument("--rows", type=positive_int, default=64, help="rows of X (tokens in the batch)")
    parser.add_argument("--width", type=positive_int, default=64, help="input width d (K of the forward matmul)")
    parser.add_argument("--out-width", type=positive_int, default=48, help="output width of the layer")
    parser.add_argument("--forward-format", type=fp8_format, default="e4m3", help="format of X and W")
    parser.add_argument("--grad-format", type=fp8_format, default="e5m2", help="format of the output gradient")
    parser.add_argument("--steps", type=positive_int, default=30, help="SGD steps of the training comparison")
    parser.add_argument("--lr", type=positive_float, default=0.1, help="SGD learning rate")
    parser.add_argument("--cost-device", choices=[k for k, v in DEVICES.items() if "fp8" in v.peak], default="h100")
    parser.add_argument("--cost-rows", type=positive_int, default=8192, help="rows (tokens) in the cost table")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    with distributed(args.device) as rt:
        verdict = Verdict(rt)
        args.place = rt.device  # every tensor of the lesson lives here; the comparisons are on one device
        print0(
            f"[bold]Lesson 14: FP8 linear layers[/] - {name_of(args.forward_format)} forward, "
            f"{name_of(args.grad_format)} gradient, {rt.device}, P = {rt.world_size} (it splits no work)"
        )
        show_formats(args, verdict)
        show_equal_to_torchao(args, verdict)
        show_bounds(args, verdict)
        show_training(args, verdict)
        verdict.figure("cost", show_cost(args))
        return verdict.finish(args.json)


if __name__ == "__main__":
    run_main(main)
