"""Exercise 01: naive model parallelism's send/recv chain, judged on 3 ranks against one process.

Each rank holds one stage of a 5-layer MLP and trains it for 2 SGD steps, each step one call of the
answer. The lesson's claims: every stage's gradients (after step 1) and parameters (after step 2) equal
the unsplit model's on the whole batch, float64 to rtol 1e-10; the loss equals the unsplit model's; and
one rank computes at a time (the others wait in recv): the spans the answer times never overlap."""

from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from exercise_kit import Exercise
from exercise_signatures import Equals, Mistake, OnRanks, Scaled, Zero
from exercise_watch import Messages

from distlab.model_split.partition import boundary_shapes, split_stages
from distlab.model_split.training import PipelineConfig, problem, train, unsplit_reference
from distlab.proof.compare import grads_of
from distlab.proof.timeline import Timeline, max_concurrency

LESSON, NAME = "model_parallel", "model_parallel_step"
P = 3
CFG = PipelineConfig(widths=(4, 6, 6, 5, 5, 3), global_batch=8, steps=2, lr=0.2, seed=3)
OWN_SUM = "the gradient of the sum of this stage's own outputs"
ELEMENTS = CFG.global_batch * CFG.widths[-1]  # N d_out: a sum over the target's elements, not their mean
BUT_LAST = OnRanks("every rank but the last", lambda p: set(range(p - 1)))


class _Step:
    """The lesson's ModelParallelStep around the answer: this rank's stage, the batch, the cut shapes."""

    def __init__(self, rt, fn):
        model, self.x, self.target = problem(CFG)
        every = split_stages(model, rt.world_size)
        self.shapes = boundary_shapes(every, tuple(self.x.shape), CFG.dtype)
        self.stages, self.timeline, self.fn = [every[rt.rank]], Timeline(rt.rank), fn
        self.sent = Messages()  # the first step's messages, for the claims on what each rank sent and received

    def __call__(self, step: int) -> float | None:
        with self.sent if step == 0 else nullcontext():
            return self.fn(
                self.stages[0].module, self.x, self.target, self.shapes, lambda kind: self.timeline.span(kind, step)
            )

    def measurements(self) -> dict:
        return {}


def _own_sum(rank: int) -> dict:
    """Stage p's gradient of sum(A_p), its own outputs (one process, the first step's weights)."""
    model, x, _ = problem(CFG)
    stages, a = split_stages(model, P), x
    for stage in stages[: rank + 1]:
        a = stage.module(a)
    a.sum().backward()
    return grads_of(stages[rank].module)


def _cuts() -> tuple[list, list]:
    """The unsplit model's A_p and dL/dA_p at every cut (one process, the first step's weights): what rank p
    sends forward to p + 1 and what rank p + 1 sends back."""
    model, x, target = problem(CFG)
    outputs, a = [], x
    for stage in split_stages(model, P):
        a = stage.module(a)
        a.retain_grad()
        outputs.append(a)
    F.mse_loss(a, target).backward()
    return [o.detach() for o in outputs], [o.grad for o in outputs]


def _factor(got: torch.Tensor, want: torch.Tensor) -> str:
    """ "0.125 x " when got is one multiple of want, else "" (the words of a note)."""
    if got is None or got.shape != want.shape:
        return ""
    k = (got * want).sum().item() / max((want * want).sum().item(), 1e-300)
    return f"{k:.6g} x " if k and torch.allclose(got, k * want, rtol=1e-9, atol=1e-300) else ""


def _messages(rt, step: _Step, run, claims) -> None:
    """What each rank sent, and what it did with what it received, in the first step: the claims that place a
    wrong number at the message or the rank where it first went wrong. Every rank makes every claim (a claim is
    agreed across ranks): one with no such message (the last rank sends nothing on) holds there."""
    p, last = rt.rank, rt.world_size - 1
    outputs, grads = _cuts()
    first = {(kind, q): (step.sent.of(kind, q) or [None])[0] for kind in ("send", "recv") for q in (p - 1, p + 1)}
    what = {"what": "the first step's messages", "tol": 1e-10}
    claim = "rank p sends its stage's output A_p to rank p + 1"
    if p < last:
        claims.close(claim, first["send", p + 1], outputs[p], **what)
    else:
        claims.holds(claim, True, what=what["what"])
    claim, got = "rank p sends dL/dA_{p-1}, the .grad of what it received, back to rank p - 1", first["send", p - 1]
    if p > 0:
        note = f"{_factor(got, grads[p - 1])}the unsplit model's dL/dA_(p-1)" if _factor(got, grads[p - 1]) else ""
        claims.close(claim, got, grads[p - 1], note=note, **what)
    else:
        claims.holds(claim, True, what=what["what"])
    claim = "rank p back-propagates the dL/dA_p it received from rank p + 1, unchanged"
    arrived, before = first["recv", p + 1], first["recv", p - 1] if p > 0 else step.x
    if p == last or arrived is None or before is None:  # no gradient to receive, or no message: other claims say
        claims.holds(claim, True, what=what["what"])
        return
    model, _, _ = problem(CFG)  # its backward from what it received, redone in one process
    stage = split_stages(model, P)[p].module
    stage(before).backward(arrived)
    want = grads_of(stage)
    factors = {_factor(run.first_grads[n], want[n]) for n in want if n in run.first_grads}
    scaled = factors.pop() if len(factors) == 1 else ""
    note = (
        f"its gradients are {scaled}the backward of what it received: it changed the received gradient first"
        if scaled
        else "its gradients are not the backward of what it received"
    )
    claims.tensors(claim, run.first_grads, want, what="dL/dtheta_p from the received dL/dA_p", note=note)


def _ranks(rt, model_parallel_step, claims) -> None:
    step = _Step(rt, model_parallel_step)
    run, ref = train(rt, CFG, step), unsplit_reference(CFG)
    claims.tensors(
        "every stage's gradients after step 1 equal the unsplit model's",
        run.first_grads,
        {n: ref.first_grads[n] for n in run.first_grads},
        what="dL/dtheta_p",
        alternatives={OWN_SUM: _own_sum(rt.rank)},
    )
    claims.tensors(
        "every stage's parameters after step 2 equal the unsplit model's",
        run.params,
        {n: ref.params[n] for n in run.params},
        what="theta_p",
    )
    claims.equal(
        "the loss equals the unsplit model's",
        run.losses,
        ref.losses,
        ok=all(abs(a - b) < 1e-10 for a, b in zip(run.losses, ref.losses)),
        what="the losses",
    )
    peak = max_concurrency(run.spans)
    claims.equal(
        "one rank computes at a time",
        peak,
        1,
        what="ranks computing at once",
        hints=("time only the compute: a span opened before recv returns counts the wait as work",),
    )
    _messages(rt, step, run, claims)


MISTAKES = (
    Mistake(
        "zeros sent back for dL/dA",
        "gradients after step 1",
        (BUT_LAST, Zero()),
        (
            "the last stage is right and every stage before it gets nothing: what does it send back?",
            "a received tensor has no graph: unless it requires grad, its .grad after the backward stays None",
            "a_in.requires_grad_() right after dist.recv, then send a_in.grad",
        ),
    ),
    Mistake(
        "the received gradient ignored",
        "gradients after step 1",
        (BUT_LAST, Equals(OWN_SUM)),
        (
            "each stage before the last back-propagates as if its outputs were a loss of their own",
            "dL/dA_p comes from rank p + 1: resume the backward from it, not from ones",
            "a_out.backward(grad_out) with grad_out the tensor received from rank p + 1",
        ),
    ),
    Mistake(
        "a sum, not a mean, as the loss",
        "gradients after step 1",
        (Scaled("N d_out", lambda p: ELEMENTS),),
        (
            "every gradient is the same multiple of the reference's: the loss's scale",
            "the unsplit model's loss is the mean squared error over all N d_out elements",
            "loss = F.mse_loss(a_out, target) (reduction 'mean')",
        ),
    ),
)


def _chain(stage, x, target, shapes, span, slip: str | None):
    """The send/recv chain as a learner writes it, with one slip (None: none): "ones", "zeros", "sum",
    "timed waits". Six parameters: the answer's five and the slip."""
    p, last = dist.get_rank(), dist.get_world_size() - 1
    a_in = x
    if p > 0:
        a_in = torch.empty(shapes[p], dtype=x.dtype)
        with span("F") if slip == "timed waits" else nullcontext():
            dist.recv(a_in, src=p - 1)
        a_in.requires_grad_(slip != "zeros")
    with span("F"):
        a_out = stage(a_in)
    if p < last:
        dist.send(a_out.detach(), dst=p + 1)
        grad_out = torch.empty_like(a_out)
        with span("I") if slip == "timed waits" else nullcontext():
            dist.recv(grad_out, src=p + 1)
        with span("I"):
            a_out.backward(torch.ones_like(grad_out) if slip == "ones" else grad_out)
    else:
        with span("I"):
            loss = F.mse_loss(a_out, target, reduction="sum" if slip == "sum" else "mean")
            loss.backward()
    if p > 0:
        dist.send(a_in.grad if a_in.grad is not None else torch.zeros_like(a_in), dst=p - 1)
    return loss.item() if p == last else None


def zeros_sent_back(stage, x, target, shapes, span):
    """The received activation never marked requires_grad: its .grad is None, and zeros go back instead."""
    return _chain(stage, x, target, shapes, span, "zeros")


def ignores_the_received_gradient(stage, x, target, shapes, span):
    """Every message right, but rank p < P - 1 resumes its backward from ones, not the dL/dA_p it received."""
    return _chain(stage, x, target, shapes, span, "ones")


def sum_loss(stage, x, target, shapes, span):
    """The squared error summed over the N d_out elements."""
    return _chain(stage, x, target, shapes, span, "sum")


def waits_timed_as_work(stage, x, target, shapes, span):
    """Right numbers, but the recvs inside the timed spans: waiting counted as computing."""
    return _chain(stage, x, target, shapes, span, "timed waits")


# World sizes: P = 3 only: a first, a middle and a last stage all occur; a fourth rank adds another middle and no
# claim reads differently.
EXERCISE = Exercise(
    LESSON,
    NAME,
    _ranks,
    P,
    MISTAKES,
    hints=(
        "activations go down the stages, gradients come back up, one message each way per stage boundary",
        "forward: receive A_{p-1}, compute A_p, send it; backward: receive dL/dA_p, back-propagate, send "
        "dL/dA_{p-1}, the .grad of what you received",
        "recv into torch.empty(shapes[p]), requires_grad_(); a_out = stage(a_in); send a_out.detach(); "
        "a_out.backward(grad_out); send a_in.grad",
    ),
    numbers="equal",
)
WRONG = {
    "zeros sent back for dL/dA": "zeros_sent_back",
    "the received gradient ignored": "ignores_the_received_gradient",
    "a sum, not a mean, as the loss": "sum_loss",
}
test_exercise, test_the_blank_is_not_written_yet, test_the_judge_names_the_mistake = EXERCISE.tests(
    Path(__file__), WRONG
)
test_the_judge_checks_beyond_numbers = EXERCISE.structure_test(Path(__file__), {"waits_timed_as_work": "one rank"})

test_the_judge_rejects_a_planted_slip = EXERCISE.audit_test(Path(__file__))
test_the_judge_rejects_a_second_slip = EXERCISE.audit_test(Path(__file__), second=True)
