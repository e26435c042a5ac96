"""Exercise 06: data parallelism by hand, judged on 3 ranks against one process on the whole batch.

Each rank builds the same model, runs backward on the mean loss over its C rows, calls the answer, and
takes an SGD step. The lesson's claims: after the answer every rank's gradients equal one process's on all
N rows, and after 2 steps so do the parameters (float64, rtol 1e-10)."""

from pathlib import Path

import torch
import torch.distributed as dist
from exercise_kit import Answer, exercise_tests, judge

from distlab.models import layered_mlp, regression_batch

LESSON, NAME = "06_data_parallel", "all_reduce_gradients"
P, C, WIDTHS, STEPS, LR = 3, 4, (5, 8, 3), 2, 0.1


def _max_rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-300)).item()


def _ranks(rt, all_reduce_gradients, claims) -> None:
    model, ref = layered_mlp(WIDTHS, seed=1), layered_mlp(WIDTHS, seed=1)
    x, y = regression_batch(P * C, WIDTHS[0], WIDTHS[-1], seed=2)
    rows = slice(rt.rank * C, (rt.rank + 1) * C)
    for step in range(STEPS):
        model.zero_grad(), ref.zero_grad()
        torch.nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
        all_reduce_gradients(model, rt)
        torch.nn.functional.mse_loss(ref(x), y).backward()  # one process, all N rows
        errs = [_max_rel(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters())]
        if not claims.check(
            f"step {step + 1}: the gradients equal one process's on the whole batch",
            max(errs) < 1e-10,
            f"largest relative difference {max(errs):.2e}",
            "sum the gradients over ranks with dist.all_reduce, then divide by P",
        ):
            return
        with torch.no_grad():
            for p, q in zip(model.parameters(), ref.parameters()):
                p -= LR * p.grad
                q -= LR * q.grad
    errs = [_max_rel(p, q) for p, q in zip(model.parameters(), ref.parameters())]
    claims.check(
        "the parameters after the steps equal one process's",
        max(errs) < 1e-10,
        f"largest relative difference {max(errs):.2e}",
        "every rank must step with the same gradients",
    )


def check(answer: Answer) -> None:
    judge(_ranks, P, answer)


def sum_without_mean(model, rt) -> None:
    """A wrong answer: the sum over ranks, P times the mean."""
    for param in model.parameters():
        dist.all_reduce(param.grad)


test_exercise, test_the_judge_rejects_a_blank_and_a_wrong_answer = exercise_tests(
    LESSON, NAME, check, wrong=Answer(Path(__file__), "sum_without_mean"), wrong_claim="step 1: the gradients equal"
)
