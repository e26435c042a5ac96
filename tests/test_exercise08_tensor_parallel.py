"""Exercise 08: the operator f (identity forward, all-reduce backward), judged on 3 ranks against one
process. The lesson's claims: f's forward and backward equal what one process computes from every rank's
tensors; the MLP split with it (and the lesson's g) equals the unsplit MLP, the input's gradient and
every parameter's after 2 SGD steps (float64, rtol 1e-10); its bytes per rank are 2(P-1)/P N seq d e."""

from pathlib import Path

import torch
from exercise_kit import Answer, exercise_tests, judge

from distlab.comm.ledger import Ledger
from distlab.tensor_parallel import cost, operators
from distlab.tensor_parallel.model import BlockConfig
from distlab.tensor_parallel.operator_checks import check_operator
from distlab.tensor_parallel.runs import split_run

LESSON, NAME = "08_tensor_parallel", "Copy"
P, STEPS, LR = 3, 2, 0.5
CFG = BlockConfig(batch=2, seq=3, dim=6, heads=3, ffn=6, dropout=0.0)


def _ranks(rt, copy, claims) -> None:
    op = check_operator(rt, "f", copy)
    if not claims.check(
        "forward: f(x) = x on every rank",
        op.forward_err <= 1e-12,
        f"largest difference {op.forward_err:.2e}",
        "forward returns its input unchanged",
    ):
        return
    if not claims.check(
        "backward: the sum of every rank's gradient",
        op.backward_err <= 1e-12,
        f"largest difference {op.backward_err:.2e}",
        "all-reduce the incoming gradient over the group (a sum), and return it",
    ):
        return
    outcome = split_run(rt, CFG, "mlp", operators.Comm(copy, operators.ReduceFromTP, None, Ledger()), STEPS, LR)
    claims.check(
        "the MLP split with it equals the unsplit MLP (gradients, parameters)",
        outcome.ok,
        f"largest gradient difference {outcome.grads_max_abs:.2e}",
        "f must be the identity forward and a sum over ranks backward",
    )
    want = cost.expected_traffic(CFG, "mlp", P, False, STEPS)[("backward", "all_reduce")]
    got = outcome.ledger.sent_by.get(("backward", "all_reduce"), 0)
    claims.check(
        "bytes sent = 2(P-1)/P N seq d e per backward",
        got == want,
        f"counted {got}, formula {want}",
        'record each all-reduce: ledger.record("backward", "all_reduce", tensor, group)',
    )


def check(answer: Answer) -> None:
    judge(_ranks, P, answer)


class IdentityBackward(torch.autograd.Function):
    """A wrong answer: identity both ways, each rank keeping only its own outputs' gradient."""

    @staticmethod
    def forward(ctx, x, group, ledger):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


test_exercise, test_the_judge_rejects_a_blank_and_a_wrong_answer = exercise_tests(
    LESSON,
    NAME,
    check,
    wrong=Answer(Path(__file__), "IdentityBackward"),
    wrong_claim="backward: the sum of every rank's gradient",
)
