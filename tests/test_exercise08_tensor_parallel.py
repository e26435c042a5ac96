"""Exercise 08: the operator f (identity forward, all-reduce backward), judged on 3 ranks against one
process. The lesson's claims: f's forward and backward equal what one process computes from every rank's
tensors; the MLP split with it (and the lesson's g) equals the unsplit MLP, the input's gradient and every
parameter's after 2 SGD steps (float64, rtol 1e-10); its bytes per rank are 2(P-1)/P N seq d e per backward,
as recorded in the ledger, and the ledger recorded is what the judge sees sent."""

from pathlib import Path

import torch
import torch.distributed as dist
from exercise_kit import Exercise
from exercise_signatures import Equals, Mistake, Scaled
from exercise_watch import Watch

from distlab.comm.ledger import Ledger
from distlab.layer_split.tensor_parallel import cost, operators
from distlab.layer_split.tensor_parallel.model import BlockConfig
from distlab.layer_split.tensor_parallel.operator_checks import MATH, check_operator
from distlab.layer_split.tensor_parallel.runs import split_run

LESSON, NAME = "tensor_parallel", "Copy"
P, STEPS, LR = 3, 2, 0.5
CFG = BlockConfig(batch=2, seq=3, dim=6, heads=3, ffn=6, dropout=0.0)
SUM_X = "the sum of every rank's input (g's forward: an all-reduce)"
OWN_GRAD = "this rank's own gradient (an identity backward)"


def _ranks(rt, copy, claims) -> None:
    make_x, make_w, _, _ = MATH["f"]
    xs, ws = [make_x(q, P) for q in range(P)], [make_w(q, P) for q in range(P)]
    with Watch() as watch:
        op = check_operator(rt, "f", copy)
    forward = claims.close(
        "forward: f(x) = x on every rank",
        op.forward,
        xs[rt.rank],
        what="f(x)",
        tol=1e-12,
        alternatives={SUM_X: sum(xs)},
    )
    backward = claims.close(
        "backward: the sum of every rank's gradient",
        op.backward,
        sum(ws),
        what="dL/dx",
        tol=1e-12,
        alternatives={OWN_GRAD: ws[rt.rank]},
    )
    whole = 2 * (P - 1) / P * xs[0].numel() * 8
    recorded = float(op.ledger.sent_by.get(("backward", "all_reduce"), 0))
    claims.equal(
        "bytes: f's backward sends one all-reduce of the gradient, and records it",
        recorded,
        whole,
        ok=watch.sent(P) == whole == recorded,
        what="bytes recorded",
        note=f"the judge saw {watch.sent(P):g} sent",
        hints=("the lesson's byte counts come from the ledger you record in: record each all-reduce you run",),
    )
    if not (forward and backward):
        return
    outcome = split_run(rt, CFG, "mlp", operators.Comm(copy, operators.ReduceFromTP, None, Ledger()), STEPS, LR)
    claims.equal(
        "the MLP split with it equals the unsplit MLP (gradients, parameters)",
        outcome.against["gradients"].max_abs,
        0.0,
        ok=outcome.ok,
        what="largest gradient difference",
    )
    want = cost.expected_traffic(CFG, "mlp", P, False, STEPS)[("backward", "all_reduce")]
    got = outcome.ledger.sent_by.get(("backward", "all_reduce"), 0)
    claims.equal("bytes recorded = 2(P-1)/P N seq d e per backward", float(got), float(want), what="bytes recorded")


MISTAKES = (
    Mistake(
        "an identity backward",
        "backward:",
        (Equals(OWN_GRAD),),
        (
            "each rank's backward sees only the gradient through its own columns of the next layer",
            "dL/dX is the sum over ranks of what each rank's columns send back: reduce it over the group",
            "in backward: grad = grad.contiguous().clone(); dist.all_reduce(grad, group=ctx.group); return grad, "
            "None, None",
        ),
        holds=("forward:",),
    ),
    Mistake(
        "the ranks' gradients averaged",
        "backward:",
        (Scaled("1/P", lambda p: 1 / p),),
        (
            "X feeds every rank's columns: its gradient is their sum, not their mean",
            "an all-reduce sums; nothing divides by P here",
            "return the all-reduced gradient as it is",
        ),
    ),
    Mistake(
        "f and g swapped",
        "forward:",
        (Equals(SUM_X),),
        (
            "f's forward changes nothing: every rank already holds the whole X",
            "the all-reduce belongs to f's backward; the forward one is g's (after the row-parallel layer)",
            "forward: return x.view_as(x) (keep group and ledger on ctx for backward)",
        ),
    ),
)


class _Copy(torch.autograd.Function):
    """f as a learner writes it; subclasses change one thing."""

    @staticmethod
    def forward(ctx, x, group, ledger):
        ctx.group, ctx.ledger = group, ledger
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        ctx.ledger.record("backward", "all_reduce", grad, ctx.group)
        return grad, None, None


class IdentityBackward(_Copy):
    """Identity both ways, each rank keeping only its own outputs' gradient."""

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class AveragedBackward(_Copy):
    """The all-reduced gradient divided by P."""

    @staticmethod
    def backward(ctx, grad):
        summed, _, _ = _Copy.backward(ctx, grad)
        return summed / dist.get_world_size(ctx.group), None, None


class Swapped(_Copy):
    """g's rule in f's place: an all-reduce forward, the identity backward."""

    @staticmethod
    def forward(ctx, x, group, ledger):
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        ledger.record("forward", "all_reduce", x, group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class Unrecorded(_Copy):
    """Right numbers, but the all-reduce never recorded in the ledger: the lesson's byte counts see nothing."""

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None, None


EXERCISE = Exercise(
    LESSON,
    NAME,
    _ranks,
    P,
    MISTAKES,
    hints=(
        "X goes to every rank's columns unchanged; its gradient comes back in pieces, one per rank",
        "forward: the identity; backward: the sum over the group of the incoming gradients, recorded as sent",
        "forward returns x.view_as(x); backward all-reduces a clone of grad over ctx.group, records it in "
        "ctx.ledger, returns (grad, None, None)",
    ),
    numbers="forward:|backward:|MLP",
)
WRONG = {
    "an identity backward": "IdentityBackward",
    "the ranks' gradients averaged": "AveragedBackward",
    "f and g swapped": "Swapped",
}
test_exercise, test_the_blank_is_not_written_yet, test_the_judge_names_the_mistake = EXERCISE.tests(
    Path(__file__), WRONG
)
test_the_judge_checks_beyond_numbers = EXERCISE.structure_test(Path(__file__), {"Unrecorded": "bytes"})
