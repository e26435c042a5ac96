"""Exercise 14: one FP8 matmul by hand, judged on 1 rank (the lesson splits no work) against torchao.

The rank calls the answer as a linear layer's three matmuls and compares each with torchao's Float8Linear
(tensorwise recipe: X and W in e4m3, dY in e5m2) run forward and backward on the same tensors, bit for bit;
the rowwise case with torchao's own axiswise casts (`tensor_to_scale`, `to_fp8_saturated`) through
torch._scaled_mm, bit for bit; and every product against the lesson's a-priori error bound."""

import contextlib
import copy
import logging
from pathlib import Path

import torch
from exercise_kit import Exercise, solution
from exercise_signatures import Equals, Mistake
from torch.utils._python_dispatch import TorchDispatchMode

for _noisy in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_noisy).setLevel(logging.ERROR)

from torchao.float8 import convert_to_float8_training  # noqa: E402
from torchao.float8.config import ScalingGranularity  # noqa: E402
from torchao.float8.float8_utils import tensor_to_scale, to_fp8_saturated  # noqa: E402

LESSON, NAME, P = "14_fp8_linear", "fp8_matmul", 1
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
EXACT = 1e-300  # relative error below this: equal bit for bit
UNINVERTED = "_scaled_mm given the scales rho, not 1/rho"
EMULATED = "the operands unscaled and multiplied in float32 (torchao's emulate mode)"
ONE_FORMAT = "both operands cast to a_fmt"
ROUNDED = "the kernel's product rounded to bfloat16 (out_dtype)"
LAYOUT = "torch._scaled_mm given a row-major, b column-major (the layout its GPU kernel demands)"


def _cast(t, fmt, rowwise):
    """torchao's cast: its scale (axiswise along the last dim for rowwise) and its saturated cast."""
    if rowwise:
        scale = tensor_to_scale(t, fmt, scaling_granularity=ScalingGranularity.AXISWISE, axiswise_dim=-1)
    else:
        scale = tensor_to_scale(t, fmt)
    return to_fp8_saturated(t * scale, fmt), scale


def _kernel(a, b, a_fmt, b_fmt, rowwise=False, invert=True, out_dtype=torch.float32):
    (a_q, rho_a), (bt_q, rho_b) = _cast(a, a_fmt, rowwise), _cast(b.t(), b_fmt, rowwise)
    scale_a, scale_b = (rho_a.reciprocal(), rho_b.reciprocal()) if invert else (rho_a, rho_b)
    return torch._scaled_mm(
        a_q,
        bt_q.contiguous().t(),
        scale_a=scale_a,
        scale_b=scale_b.t() if rowwise else scale_b,
        out_dtype=out_dtype,
    )


def _emulated(a, b, a_fmt, b_fmt):
    (a_q, rho_a), (bt_q, rho_b) = _cast(a, a_fmt, False), _cast(b.t(), b_fmt, False)
    return (a_q.float() / rho_a) @ (bt_q.float() / rho_b).t()


def _torchao_layer(x, weight, dy):
    """Y, dX, dW of torchao's Float8Linear (tensorwise recipe, e4m3 forward, e5m2 output gradient)."""
    plain = torch.nn.Linear(x.shape[1], weight.shape[0], bias=False)
    plain.weight.data.copy_(weight)
    layer = convert_to_float8_training(copy.deepcopy(plain))  # a bare Linear: use what it returns
    xi = x.clone().requires_grad_()
    y = layer(xi)
    y.backward(dy)
    return {"Y": y.detach(), "dX": xi.grad, "dW": layer.weight.grad}


def _ranks(rt, fp8_matmul, claims) -> None:
    gen = torch.Generator().manual_seed(14)
    x = torch.randn(24, 40, generator=gen)
    weight = torch.randn(16, 40, generator=gen) / 40**0.5
    dy = torch.randn(24, 16, generator=gen)
    x[:, 0] *= 300.0  # an outlier channel: the tensorwise scale is set by it
    ref = _torchao_layer(x, weight, dy)
    matmuls = {
        "Y = X W^T": (x, weight.t(), E4M3, E4M3, True),
        "dX = dY W": (dy, weight, E5M2, E4M3, False),
        "dW = dY^T X": (dy.t(), x, E5M2, E4M3, False),
    }
    bound = solution(LESSON, "error_bound").load()
    inside, layouts = True, Layouts()
    for (name, (a, b, fa, fb, fast)), key in zip(matmuls.items(), ref):
        with layouts.of(name):
            got = fp8_matmul(a, b, fa, fb, fast_accum=fast)
        claims.close(
            f"{name} equals torchao's Float8Linear bit for bit",
            got,
            ref[key],
            what=key,
            tol=EXACT,
            alternatives={
                UNINVERTED: _kernel(a, b, fa, fb, invert=False),
                EMULATED: _emulated(a, b, fa, fb),
                ONE_FORMAT: _kernel(a, b, fa, fa),
                ROUNDED: _kernel(a, b, fa, fb, out_dtype=torch.bfloat16).float(),
            },
        )
        inside &= bool(((got.double() - a.double() @ b.double()).abs() <= bound(a, b, fa, fb)).all())
    with layouts.of("rowwise Y"):
        got = fp8_matmul(x, weight.t(), E4M3, E4M3, rowwise=True)
    claims.close(
        "rowwise: Y equals torchao's axiswise casts through _scaled_mm bit for bit",
        got,
        _kernel(x, weight.t(), E4M3, E4M3, rowwise=True),
        what="Y (rowwise)",
        tol=EXACT,
        alternatives={"tensorwise scales": _kernel(x, weight.t(), E4M3, E4M3)},
    )
    error = (got.double() - x.double() @ weight.double().t()).abs()
    inside &= bool((error <= bound(x, weight.t(), E4M3, E4M3, True)).all())
    claims.holds("every product inside its a-priori bound", inside, what="|got - a b| against the lesson's bound")
    claims.equal(
        LAYOUT,
        layouts.wrong() or "a row-major, b column-major in every call",
        "a row-major, b column-major in every call",
        what="the operands' layouts the answer handed to torch._scaled_mm",
        hints=(
            "torch._scaled_mm's GPU kernel takes a row-major and b column-major (it raises on any other layout; "
            "the CPU's accepts both): b column-major is the transpose of a contiguous b^T",
            "cast b.t() (b's columns as rows), make that contiguous, and hand _scaled_mm its .t(): a view, "
            "column-major, no copy",
            "torch._scaled_mm(a_q.contiguous(), bt_q.contiguous().t(), ...), not bt_q.t().contiguous()",
        ),
    )


class Layouts(TorchDispatchMode):
    """The layouts of the operands of every torch._scaled_mm run under it: (the matmul's name, a's, b's), each
    "row-major", "column-major" or its strides; `of(name)` enters it for one matmul."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, str, str]] = []
        self.name = ""

    @contextlib.contextmanager
    def of(self, name: str):
        self.name = name
        with self:
            yield

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "aten" and func.__name__.split(".")[0] == "_scaled_mm":
            self.calls.append((self.name, layout(args[0]), layout(args[1])))
        return func(*args, **(kwargs or {}))

    def wrong(self) -> str:
        """Each operand's wrong layout and the matmuls it came in: "b row-major in every call"."""
        parts = []
        for k, (operand, want) in enumerate((("a", "row-major"), ("b", "column-major")), start=1):
            where: dict[str, list[str]] = {}
            for call in self.calls:
                if call[k] != want:
                    where.setdefault(call[k], []).append(call[0])
            for got, names in where.items():
                parts.append(
                    f"{operand} {got} in {'every call' if len(names) == len(self.calls) else ', '.join(names)}"
                )
        return "; ".join(parts)


def layout(t: torch.Tensor) -> str:
    if t.is_contiguous():
        return "row-major"
    if t.dim() == 2 and t.t().is_contiguous():
        return "column-major"
    return f"strides {tuple(t.stride())}"


MISTAKES = (
    Mistake(
        "the scales passed uninverted",
        "Y = X W\\^T equals",
        (Equals(UNINVERTED),),
        (
            "X rho is what was cast: the product of the casts is (X W^T) rho_X rho_W, and must be divided back",
            "the scaled matmul multiplies its output by scale_a scale_b: give it 1/rho, not rho",
            "torch._scaled_mm(a_q, b_q, scale_a=rho_a.reciprocal(), scale_b=rho_b.reciprocal(), out_dtype=...)",
        ),
    ),
    Mistake(
        "the matmul emulated in float32",
        "Y = X W\\^T equals",
        (Equals(EMULATED),),
        (
            "the numbers are close but not the kernel's: torchao multiplies the 8-bit operands in the kernel",
            "unscaling the operands first and multiplying in float32 rounds differently from the kernel, which "
            "accumulates a_q b_q and applies 1/rho_a and 1/rho_b to the sum",
            "torch._scaled_mm(a_q, b_q_column_major, scale_a=1/rho_a, scale_b=1/rho_b, out_dtype=torch.float32)",
        ),
        holds=("every product inside",),
    ),
    Mistake(
        "one format for both operands",
        "dX = dY W equals",
        (Equals(ONE_FORMAT),),
        (
            "the forward is right; the backward's operands come in two formats",
            "dY is cast to a_fmt (e5m2), the weight to b_fmt (e4m3): each operand its own format",
            "quantize(a, a_fmt, rowwise) and quantize(b.t(), b_fmt, rowwise)",
        ),
        holds=("Y = X W\\^T equals",),
    ),
    Mistake(
        "the product rounded to bfloat16",
        "Y = X W\\^T equals",
        (Equals(ROUNDED),),
        (
            "the casts and the kernel are right; the result lost its low bits on the way out",
            "8-bit operands, but the kernel accumulates in float32 and the layer's output is float32: keep it",
            "torch._scaled_mm(..., out_dtype=torch.float32)",
        ),
    ),
)


def uninverted(a, b, a_fmt, b_fmt, rowwise=False, fast_accum=False):
    """s where 1/s belongs: the product comes out rho_a rho_b times too large, squared."""
    return _kernel(a, b, a_fmt, b_fmt, rowwise, invert=False)


def emulated(a, b, a_fmt, b_fmt, rowwise=False, fast_accum=False):
    """The casts right, the product computed in float32 from the unscaled operands."""
    return _emulated(a, b, a_fmt, b_fmt)


def rounded(a, b, a_fmt, b_fmt, rowwise=False, fast_accum=False):
    """Right casts and kernel, the output asked for in bfloat16."""
    return _kernel(a, b, a_fmt, b_fmt, rowwise, out_dtype=torch.bfloat16)


def one_format(a, b, a_fmt, b_fmt, rowwise=False, fast_accum=False):
    """b cast in a's format."""
    return solution(LESSON, NAME).load()(a, b, a_fmt, a_fmt, rowwise, fast_accum)


def _scaled(a_q, b_q, a_scale, b_scale, rowwise, fast_accum):
    scale_b = b_scale.reciprocal().t() if rowwise else b_scale.reciprocal()
    return torch._scaled_mm(
        a_q.contiguous(),
        b_q,
        scale_a=a_scale.reciprocal(),
        scale_b=scale_b,
        out_dtype=torch.float32,
        use_fast_accum=fast_accum,
    )


def row_major_b(a, b, a_fmt, b_fmt, rowwise=False, fast_accum=False):
    """Right numbers on the CPU, b handed over row-major: the GPU's kernel raises."""
    quantize = solution(LESSON, "quantize").load()
    (a_q, a_scale), (bt_q, b_scale) = quantize(a, a_fmt, rowwise), quantize(b.t(), b_fmt, rowwise)
    return _scaled(a_q, bt_q.t().contiguous(), a_scale, b_scale, rowwise, fast_accum)


def column_major_copy(a, b, a_fmt, b_fmt, rowwise=False, fast_accum=False):
    """Right, written another way: b's cast copied into a column-major buffer of its own."""
    quantize = solution(LESSON, "quantize").load()
    (a_q, a_scale), (bt_q, b_scale) = quantize(a, a_fmt, rowwise), quantize(b.t(), b_fmt, rowwise)
    b_q = torch.empty_strided(b.shape, (1, b.shape[0]), dtype=b_fmt)
    b_q.copy_(bt_q.t())
    return _scaled(a_q, b_q, a_scale, b_scale, rowwise, fast_accum)


# World sizes: one process: the lesson splits no work.
EXERCISE = Exercise(
    LESSON,
    NAME,
    _ranks,
    P,
    MISTAKES,
    hints=(
        "scale each operand into its format's range, cast it, multiply the 8-bit numbers, divide the scales out",
        "rho = max_f / amax (float64, then float32), clamp T rho to +-max_f, .to(fmt); torch._scaled_mm takes the "
        "inverse scales and b column-major",
        "a_q = (a * rho_a).clamp(-m, m).to(a_fmt); torch._scaled_mm(a_q, bt_q.contiguous().t(), "
        "scale_a=1/rho_a, scale_b=1/rho_b, out_dtype=torch.float32, use_fast_accum=fast_accum)",
    ),
    numbers="equals",
)
WRONG = {
    "the scales passed uninverted": "uninverted",
    "the matmul emulated in float32": "emulated",
    "one format for both operands": "one_format",
    "the product rounded to bfloat16": "rounded",
}
test_exercise, test_the_blank_is_not_written_yet, test_the_judge_names_the_mistake = EXERCISE.tests(
    Path(__file__), WRONG
)
test_the_judge_checks_beyond_numbers = EXERCISE.structure_test(Path(__file__), {"row_major_b": "_scaled_mm given"})
test_the_judge_accepts_another_way = EXERCISE.accepts_test(Path(__file__), ["column_major_copy"])

test_the_judge_rejects_a_planted_slip = EXERCISE.audit_test(Path(__file__))
test_the_judge_rejects_a_second_slip = EXERCISE.audit_test(Path(__file__), second=True)
