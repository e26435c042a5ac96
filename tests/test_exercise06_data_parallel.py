"""Exercise 06: data parallelism by hand, judged on 3 ranks against one process on the whole batch.

The model has the shapes real models have (`distlab.proof.models.RealShapes`): a parameter on the root module
(`logit_scale`), an embedding weight tied to the output layer's, a frozen tower and a frozen bias (no
gradient: nothing to reduce). Each rank builds the same model, runs backward on the mean loss over its C
rows, calls the answer, and takes an SGD step. The lesson's claims: after the answer every rank's gradients
equal one process's on all N rows, and after 2 steps so do the parameters (float64, rtol 1e-10); and a step
sends no more than one all-reduce of every gradient, 2 (P-1)/P Psi e bytes (the judge prices the
collectives it sees)."""

import copy
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from exercise_kit import Exercise
from exercise_signatures import Equals, Mistake, Scaled, Tensors, all_but
from exercise_watch import Watch

from distlab.proof.compare import grads_of
from distlab.proof.models import RealShapes, regression_batch

LESSON, NAME = "data_parallel", "all_reduce_gradients"
P, C, V, D, STEPS, LR = 3, 4, 5, 4, 2, 0.1
SHAPES = dict(v=V, d=D, seed=1, without=("unused",))
OWN, FIRST, OWN_BY_P = "this rank's own rows' gradient", "rank 0's rows' gradient", "this rank's own gradient / P"


def _trained(model) -> list:
    """The parameters a step trains: those that require grad, each tensor once (a tied weight is one)."""
    return [p for p in model.parameters() if p.requires_grad]


def _local_gradients(model, x, y) -> list[dict]:
    """Each rank's dL_r/dtheta (the mean over its own C rows), in one process, on copies."""
    out = []
    for r in range(P):
        twin = copy.deepcopy(model)
        twin.zero_grad()
        torch.nn.functional.mse_loss(twin(x[r * C : (r + 1) * C]), y[r * C : (r + 1) * C]).backward()
        out.append(grads_of(twin))
    return out


def _ranks(rt, all_reduce_gradients, claims) -> None:
    model, ref = RealShapes(**SHAPES), RealShapes(**SHAPES)
    x, y = regression_batch(P * C, V, V, seed=2)
    rows, psi = slice(rt.rank * C, (rt.rank + 1) * C), sum(p.numel() for p in _trained(model))
    for step in range(STEPS):
        local = _local_gradients(model, x, y)
        model.zero_grad(), ref.zero_grad()
        torch.nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
        with Watch() as watch:
            all_reduce_gradients(model, rt)
        torch.nn.functional.mse_loss(ref(x), y).backward()  # one process, all N rows
        own = local[rt.rank]
        if not claims.tensors(
            f"step {step + 1}: the gradients equal one process's on the whole batch",
            grads_of(model),
            grads_of(ref),
            what="the gradients",
            alternatives={OWN: own, FIRST: local[0], OWN_BY_P: {n: g / P for n, g in own.items()}},
            hints=("dL/dtheta is the mean over all N rows: what does each rank lack?",),
        ):
            return
        claims.equal(
            f"step {step + 1}: bytes sent <= one all-reduce of every gradient, 2 (P-1)/P Psi e",
            watch.sent(P),
            2 * (P - 1) / P * psi * 8,
            ok=watch.sent(P) <= 2 * (P - 1) / P * psi * 8 * (1 + 1e-12),
            what="bytes sent (ring formulas)",
            note=f"collectives: {dict(watch.calls())}",
        )
        with torch.no_grad():
            for p, q in zip(_trained(model), _trained(ref)):
                p -= LR * p.grad
                q -= LR * q.grad
    claims.tensors(
        "the parameters after the steps equal one process's",
        dict(model.named_parameters()),
        dict(ref.named_parameters()),
        what="the parameters",
    )


MISTAKES = (
    Mistake(
        "the sum over ranks, not the mean",
        "gradients equal",
        (Scaled("P", lambda p: p),),
        (
            "an all-reduce sums; the loss is a mean over all N rows",
            "after the sum every rank holds sum_r dL_r/dtheta = P dL/dtheta",
            "divide every reduced gradient by rt.world_size",
        ),
    ),
    Mistake(
        "the all-reduce ran on a copy",
        "gradients equal",
        (Equals(OWN),),
        (
            "param.grad still holds this rank's own gradient: the reduction never reached it",
            "dist.all_reduce works in place on the tensor you pass; `param.grad / P` is a new tensor",
            "all-reduce param.grad itself, then divide it in place (param.grad /= P)",
        ),
    ),
    Mistake(
        "the root module's own parameter left out",
        "gradients equal",
        (Tensors(("logit_scale",)),),
        (
            "one gradient is still this rank's own: a parameter no layer holds",
            "the model itself holds logit_scale; looping over its children's parameters never reaches it",
            "loop over model.parameters() (those that require grad): every parameter, the root's included",
        ),
    ),
    Mistake(
        "a reduce to one rank, not an all-reduce",
        "gradients equal",
        (all_but(0),),
        (
            "only rank 0 ends with the mean: the other replicas step with something else and drift apart",
            "dist.reduce leaves the sum on its destination only; every replica needs it to take the same step",
            "dist.all_reduce(param.grad) on every rank (not dist.reduce), then divide by P",
        ),
    ),
    Mistake(
        "a broadcast, not a reduction",
        "gradients equal",
        (Equals(FIRST),),
        (
            "every rank holds rank 0's gradient: the replicas agree, but on 1/P of the batch",
            "agreeing is not enough: every rank's rows must count, so sum over ranks",
            "dist.all_reduce(param.grad) on every rank, then divide by P",
        ),
    ),
)


def sum_without_mean(model, rt) -> None:
    """The sum over ranks, P times the mean."""
    for param in _trained(model):
        dist.all_reduce(param.grad)


def reduced_copy(model, rt) -> None:
    """The division first: the all-reduce sums a new tensor, and param.grad is never touched."""
    for param in _trained(model):
        dist.all_reduce(param.grad / rt.world_size)


def children_only(model, rt) -> None:
    """The layers' parameters averaged, the root's own (logit_scale) never reached."""
    for child in model.children():
        for param in child.parameters():
            if param.requires_grad:
                dist.all_reduce(param.grad)
                param.grad /= rt.world_size


def broadcast_from_zero(model, rt) -> None:
    """Every replica made equal to rank 0's: the same gradients everywhere, of rank 0's rows only."""
    for param in _trained(model):
        dist.broadcast(param.grad, src=0)


def reduce_to_zero(model, rt) -> None:
    """The sum sent to rank 0 alone: rank 0 right, the others left with partial sums (the ranks disagree)."""
    for param in _trained(model):
        dist.reduce(param.grad, dst=0)
        param.grad /= rt.world_size


def gathered_mean(model, rt) -> None:
    """Right numbers, the wrong collective: every rank's whole gradient gathered, then averaged here."""
    for param in _trained(model):
        every = [torch.empty_like(param.grad) for _ in range(rt.world_size)]
        dist.all_gather(every, param.grad)
        param.grad.copy_(torch.stack(every).mean(0))


def with_a_barrier(model, rt) -> None:
    """Right, written another way: the lesson's answer, then every rank waits for the others."""
    for param in _trained(model):
        dist.all_reduce(param.grad)
        param.grad /= rt.world_size
    dist.barrier()


def functional_all_reduce(model, rt) -> None:
    """Right, written another way: a functional collective (what DTensor runs), copied back in place."""
    for param in _trained(model):
        param.grad.copy_(funcol.all_reduce(param.grad, "avg", dist.group.WORLD).wait())


# World sizes: P = 3 only: 1/P against 1/P^2 and 2 (P-1)/P Psi against (P-1) Psi already differ at P = 3 (they meet at
# P = 2).
EXERCISE = Exercise(
    LESSON,
    NAME,
    _ranks,
    P,
    MISTAKES,
    hints=(
        "each rank's gradient covers its C rows; the step needs the mean over all N",
        "combine the ranks' gradients with one collective, then rescale so a mean stays a mean",
        "for every parameter: dist.all_reduce(param.grad), then param.grad /= rt.world_size",
    ),
    quantities=lambda p: {"C": C, "N": p * C},
)
WRONG = {
    "the sum over ranks, not the mean": "sum_without_mean",
    "the all-reduce ran on a copy": "reduced_copy",
    "a broadcast, not a reduction": "broadcast_from_zero",
    "a reduce to one rank, not an all-reduce": "reduce_to_zero",
    "the root module's own parameter left out": "children_only",
}
test_exercise, test_the_blank_is_not_written_yet, test_the_judge_names_the_mistake = EXERCISE.tests(
    Path(__file__), WRONG
)
test_the_judge_checks_beyond_numbers = EXERCISE.structure_test(Path(__file__), {"gathered_mean": "bytes sent"})
test_the_judge_accepts_another_way = EXERCISE.accepts_test(Path(__file__), ["with_a_barrier", "functional_all_reduce"])

test_the_judge_rejects_a_planted_slip = EXERCISE.audit_test(Path(__file__))
test_the_judge_rejects_a_second_slip = EXERCISE.audit_test(Path(__file__), second=True)
