"""Exercise 08: the operator f (identity forward, all-reduce backward), judged on 3 ranks against one
process, then at P = 4 as two groups of two with different inputs, where an all-reduce that ignores the
group it is given sums over the whole world. The lesson's claims: f's forward and backward equal what one
process computes from every group rank's tensors; the MLP split with it (and the lesson's g) equals the
unsplit MLP, the input's gradient and every parameter's after 2 SGD steps (float64, rtol 1e-10); its bytes
per rank are 2(p-1)/p N seq d e per backward (p the group's size), as recorded in the ledger, and the
ledger recorded is what the judge sees sent."""

from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from exercise_kit import Exercise
from exercise_signatures import Equals, Mistake, Scaled
from exercise_watch import NOT_COLLECTIVES, Watch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from distlab.comm.ledger import Ledger
from distlab.layer_split.tensor_parallel import cost, operators
from distlab.layer_split.tensor_parallel.model import BlockConfig
from distlab.layer_split.tensor_parallel.runs import split_run
from distlab.proof.sizes import Transformer

LESSON, NAME = "tensor_parallel", "Copy"
P, PAIRS, STEPS, LR = 3, 4, 2, 0.5  # the whole world of 3; at 4 ranks, two groups of 2
CFG = BlockConfig(Transformer(layers=1, dim=6, heads=3, ffn=6), batch=2, seq=3, dropout=0.0)
SUM_X = "the sum of every rank's input (g's forward: an all-reduce)"
OWN_GRAD = "this rank's own gradient (an identity backward)"
WORLD_SUM = "the sum over every rank of the world, not of the group"
P_TIMES_OWN = "p times this rank's own gradient (as if every rank's were the same)"
RETURNS = "f's backward returns the all-reduce of the gradient it was given"
SUMMED = "the all-reduce of the gradient it was given"


def _tensor(group_index: int, q: int, p: int, salt: int) -> torch.Tensor:
    """Group rank q's tensor in group `group_index` of size p: distinct in every group and every rank."""
    gen = torch.Generator().manual_seed(10_000 * salt + 100 * group_index + q)
    return torch.randn(2, 2 * p, 3, generator=gen, dtype=torch.float64)


def _group(rt) -> tuple:
    """(the group f runs on, its index): the world at P = 3, and at P = 4 this rank's pair {0, 1} or {2, 3}
    (every rank builds both: new_group is collective)."""
    if rt.world_size != PAIRS:
        return None, 0
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    return pairs[rt.rank // 2], rt.rank // 2


def _ranks(rt, copy, claims) -> None:
    group, index = _group(rt)
    p, r = dist.get_world_size(group), dist.get_rank(group)
    xs, ws = [_tensor(index, q, p, 1) for q in range(p)], [_tensor(index, q, p, 2) for q in range(p)]
    everyone = sum(_tensor(g, q, p, 2) for g in range(rt.world_size // p) for q in range(p))
    x, ledger = xs[r].clone().requires_grad_(), Ledger()
    with Watch() as watch:
        out = copy.apply(x, group, ledger)
        with Reduced() as reduced:
            (out * ws[r]).sum().backward()
    forward = claims.close(
        "forward: f(x) = x on every rank",
        out,
        xs[r],
        what="f(x)",
        tol=1e-12,
        alternatives={SUM_X: sum(xs)},
    )
    said = returned(x.grad, ws[r], reduced.runs())
    claims.equal(
        RETURNS,
        said,
        SUMMED,
        ok=said == SUMMED,
        what="what f's backward returned",
        hints=(
            "f's backward is one all-reduce of the gradient it was given, and returns its result: dist.all_reduce "
            "sums in place, into the tensor it is handed",
        ),
    )
    backward = claims.close(
        "backward: the sum of the group's gradients",
        x.grad,
        sum(ws),
        what="dL/dx",
        tol=1e-12,
        alternatives={
            OWN_GRAD: ws[r],
            P_TIMES_OWN: p * ws[r],
            **({WORLD_SUM: everyone} if group is not None else {}),
        },
    )
    whole = 2 * (p - 1) / p * xs[0].numel() * 8
    recorded = float(ledger.sent_by.get(("backward", "all_reduce"), 0))
    claims.equal(
        "bytes: f's backward sends one all-reduce of the gradient, and records it",
        f"{recorded:g} recorded, {watch.sent(rt.world_size):g} sent",
        f"{whole:g} recorded, {whole:g} sent",
        ok=watch.sent(rt.world_size) == whole == recorded,
        what="bytes f's backward recorded and the judge saw it send",
        hints=("the lesson's byte counts come from the ledger you record in: record each all-reduce you run",),
    )
    if not (forward and backward):
        return
    outcome = split_run(rt, CFG, "mlp", operators.Comm(copy, operators.ReduceFromTP, group, Ledger()), STEPS, LR)
    claims.equal(
        "the MLP split with it equals the unsplit MLP (gradients, parameters)",
        outcome.against["gradients"].max_abs,
        0.0,
        ok=outcome.ok,
        what="largest gradient difference",
    )
    want = cost.expected_traffic(CFG, "mlp", p, False, STEPS)[("backward", "all_reduce")]
    got = outcome.ledger.sent_by.get(("backward", "all_reduce"), 0)
    claims.equal("bytes recorded = 2(p-1)/p N seq d e per backward", float(got), float(want), what="bytes recorded")


class Reduced(TorchDispatchMode):
    """Every all-reduce run under it, as (a copy of its input, a copy of its result): the input copied before the
    op, the result once it holds the sum: when an op but a collective's wait or wrapping reads it (gloo fills an
    in-place all-reduce after its op, a functional one by its wait, and the answer may change it in place
    afterwards), or at exit."""

    def __init__(self) -> None:
        super().__init__()
        self.inputs: list[torch.Tensor] = []
        self.results: dict[int, torch.Tensor] = {}
        self._pending: list[tuple[int, torch.Tensor]] = []

    def _filled(self, storages=None) -> None:
        ready = [(k, t) for k, t in self._pending if storages is None or _storage(t) in storages]
        self._pending = [(k, t) for k, t in self._pending if all(k != j for j, _ in ready)]  # first: copies pass here
        self.results.update((k, t.detach().clone()) for k, t in ready)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if name not in NOT_COLLECTIVES and self._pending:  # not at its wait, nor its wrapping
            self._filled({_storage(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)})
        functional = func.namespace.startswith("_c10d_functional") and name.startswith("all_reduce")
        reduces = functional or (func.namespace == "c10d" and name in ("allreduce_", "allreduce_coalesced_"))
        given = [t for t in tree_leaves(args[0]) if isinstance(t, torch.Tensor)] if reduces else []
        self.inputs += [t.detach().clone() for t in given]
        out = func(*args, **(kwargs or {}))
        made = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)] if functional and name[-1] != "_" else given
        self._pending += [(len(self.inputs) - len(given) + k, t) for k, t in enumerate(made)]
        return out

    def __exit__(self, *exc):
        self._filled()
        return super().__exit__(*exc)

    def runs(self) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        return [(t, self.results.get(k)) for k, t in enumerate(self.inputs)]


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _factor(got, value) -> float | None:
    """k with got = k value, if there is one."""
    if got is None or value is None or got.shape != value.shape or not (value * value).sum() > 0:
        return None
    k = ((got * value).sum() / (value * value).sum()).item()
    return k if torch.allclose(got, k * value, rtol=1e-12, atol=0) else None


def _equal(got, value) -> bool:
    k = _factor(got, value)
    return k is not None and abs(k - 1) < 1e-12


def _times(k: float) -> str:
    return "" if abs(k - 1) < 1e-12 else f"{k:.6g} x "


def returned(grad, given, runs) -> str:
    """What f's backward returned, against what its all-reduces produced from what: the all-reduce of the
    gradient it was given (`SUMMED`), of an earlier all-reduce's result, of a multiple of it, or no all-reduce's."""
    if not runs:
        return SUMMED
    if grad is None:
        return "nothing: no gradient reached x"
    for k, (sent, result) in enumerate(runs):
        if _equal(grad, result):
            if _factor(sent, given) is not None:
                return f"the all-reduce of {_times(_factor(sent, given))}the gradient it was given"
            if any(_equal(sent, earlier) for _, earlier in runs[:k]):
                return "the all-reduce of an earlier all-reduce's result: the gradient all-reduced twice"
            return "the all-reduce of something other than the gradient it was given"
    for value, words in [(t, "the result of its all-reduce") for _, t in runs] + [(given, "the gradient it was given")]:
        k = _factor(grad, value)
        if k is not None:
            return f"{_times(k)}{words}" + (" (its all-reduce's result left unused)" if "given" in words else "")
    return "neither a multiple of its all-reduce's result nor of the gradient it was given"


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
        holds=("forward:", RETURNS),
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
        "the all-reduce on the whole world, not the group",
        "backward:",
        (Equals(WORLD_SUM),),
        (
            "f is handed its group: on a mesh, the tensor-parallel group is a few ranks, not the world",
            "dist.all_reduce without group= reduces over every rank of the job; sum over ctx.group only",
            "dist.all_reduce(grad, group=ctx.group), and record it with the same group",
        ),
        holds=("forward:",),
    ),
    Mistake(
        "the sum taken as P copies of this rank's gradient",
        "backward:",
        (Equals(P_TIMES_OWN),),
        (
            "the ranks' gradients differ: each comes through its own columns of the next layer",
            "the sum over the group needs every rank's gradient, which only a collective brings",
            "in backward: grad = grad.contiguous().clone(); dist.all_reduce(grad, group=ctx.group)",
        ),
        holds=("forward:",),
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


class TimesP(_Copy):
    """No collective: the sum over the group taken as P times this rank's own gradient."""

    @staticmethod
    def backward(ctx, grad):
        return grad * dist.get_world_size(ctx.group), None, None


class WorldAllReduce(_Copy):
    """The group ignored: the gradient summed over every rank of the job (recorded against the group)."""

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad)
        ctx.ledger.record("backward", "all_reduce", grad, ctx.group)
        return grad, None, None


class FunctionalAllReduce(_Copy):
    """Right, written another way: the backward's all-reduce a functional collective (what DTensor runs)."""

    @staticmethod
    def backward(ctx, grad):
        summed = funcol.all_reduce(grad.contiguous(), "sum", ctx.group or dist.group.WORLD).wait()
        ctx.ledger.record("backward", "all_reduce", summed, ctx.group)
        return summed, None, None


class Unrecorded(_Copy):
    """Right numbers, but the all-reduce never recorded in the ledger: the lesson's byte counts see nothing."""

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None, None


# World sizes: P = 3 (the whole world) and P = 4 as two groups of two (also_at): a group ignored sums over the world.
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
    also_at=(PAIRS,),
)
WRONG = {
    "an identity backward": "IdentityBackward",
    "the ranks' gradients averaged": "AveragedBackward",
    "f and g swapped": "Swapped",
    "the all-reduce on the whole world, not the group": "WorldAllReduce",
    "the sum taken as P copies of this rank's gradient": "TimesP",
}
test_exercise, test_the_blank_is_not_written_yet, test_the_judge_names_the_mistake = EXERCISE.tests(
    Path(__file__), WRONG
)
test_the_judge_checks_beyond_numbers = EXERCISE.structure_test(Path(__file__), {"Unrecorded": "bytes"})
test_the_judge_accepts_another_way = EXERCISE.accepts_test(Path(__file__), ["FunctionalAllReduce"])

test_the_judge_rejects_a_planted_slip = EXERCISE.audit_test(Path(__file__))
test_the_judge_rejects_a_second_slip = EXERCISE.audit_test(Path(__file__), second=True)
