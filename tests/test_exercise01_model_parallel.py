"""Exercise 01: naive model parallelism's send/recv chain, judged on 3 ranks against one process.

Each rank holds one stage of a 5-layer MLP and trains it for 2 SGD steps, each step one call of the
answer. The lesson's claims: every stage's gradients (after step 1) and parameters (after step 2) equal
the unsplit model's on the whole batch, float64 to rtol 1e-10; the loss equals the unsplit model's; and
one rank computes at a time (the others wait in recv)."""

from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from exercise_kit import Answer, exercise_tests, judge

from distlab.compare import all_ok, compare
from distlab.pipeline.partition import boundary_shapes, split_stages
from distlab.pipeline.training import PipelineConfig, problem, train, unsplit_reference
from distlab.timeline import Timeline, max_concurrency

LESSON, NAME = "01_model_parallel", "model_parallel_step"
P = 3
CFG = PipelineConfig(widths=(4, 6, 6, 5, 5, 3), global_batch=8, steps=2, lr=0.2, seed=3)


class _Step:
    """The lesson's ModelParallelStep around the answer: this rank's stage, the batch, the cut shapes."""

    def __init__(self, rt, fn):
        model, self.x, self.target = problem(CFG)
        every = split_stages(model, rt.world_size)
        self.shapes = boundary_shapes(every, tuple(self.x.shape), CFG.dtype)
        self.stages, self.timeline, self.fn = [every[rt.rank]], Timeline(rt.rank), fn

    def __call__(self, step: int) -> float | None:
        return self.fn(
            self.stages[0].module, self.x, self.target, self.shapes, lambda kind: self.timeline.span(kind, step)
        )

    def measurements(self) -> dict:
        return {}


def _ranks(rt, model_parallel_step, claims) -> None:
    run, ref = train(rt, CFG, _Step(rt, model_parallel_step)), unsplit_reference(CFG)
    for what, got, want, hint in (
        (
            "gradients after step 1",
            run.first_grads,
            ref.first_grads,
            "resume the backward from the dL/dA_p you received; send your input's .grad to rank p - 1",
        ),
        ("parameters after step 2", run.params, ref.params, "every stage must run its backward once per step"),
    ):
        rows = compare({n: want[n] for n in got}, got)
        claims.check(
            f"every stage's {what} equal the unsplit model's",
            all_ok(rows),
            "; ".join(f"{r.name}: {r.max_abs:.1e}" for r in rows if not r.ok)[:200],
            hint,
        )
    claims.check(
        "the loss equals the unsplit model's",
        all(abs(a - b) < 1e-10 for a, b in zip(run.losses, ref.losses)),
        f"{run.losses} against {ref.losses}",
        "return mse(A_{P-1}, target).item() on the last rank",
    )
    peak = max_concurrency(run.spans)
    claims.check(
        "one rank computes at a time",
        peak == 1,
        f"{peak} ranks at once",
        "rank p computes only after its recv has returned",
    )


def check(answer: Answer) -> None:
    judge(_ranks, P, answer)


def ignores_the_received_gradient(stage, x, target, shapes, span):
    """A wrong answer: every message right, but rank p < P - 1 resumes its backward from ones instead of
    the dL/dA_p it received (a stage treated as if it had its own loss, the sum of its outputs)."""
    p, last = dist.get_rank(), dist.get_world_size() - 1
    a_in = x
    if p > 0:
        a_in = torch.empty(shapes[p], dtype=x.dtype)
        dist.recv(a_in, src=p - 1)
        a_in.requires_grad_()
    with span("F"):
        a_out = stage(a_in)
    if p < last:
        dist.send(a_out.detach(), dst=p + 1)
        grad_out = torch.empty_like(a_out)
        dist.recv(grad_out, src=p + 1)
        with span("I"):
            a_out.backward(torch.ones_like(grad_out))
    else:
        with span("I"):
            loss = F.mse_loss(a_out, target)
            loss.backward()
    if p > 0:
        dist.send(a_in.grad, dst=p - 1)
    return loss.item() if p == last else None


test_exercise, test_the_judge_rejects_a_blank_and_a_wrong_answer = exercise_tests(
    LESSON,
    NAME,
    check,
    wrong=Answer(Path(__file__), "ignores_the_received_gradient"),
    wrong_claim="gradients after step 1 equal the unsplit model's",
)
