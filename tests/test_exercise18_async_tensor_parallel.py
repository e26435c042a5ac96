"""Exercise 18: all-gather + matmul as a ring, judged on 3 ranks against one process holding the whole X.

Each rank takes its block of X (the sequence cut in contiguous blocks), the column weight and bias of its
outputs, and a clock of the lesson's (`Clock`: it records the partial matmuls and the messages). The lesson's
claims: X gathered and Y = X W_r^T + b_r equal one process's, bit for bit; the messages send (P-1)/P of X,
as a ring all-gather does; and each of the P - 1 messages is in flight while a partial matmul runs."""

from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from exercise_kit import Exercise
from exercise_signatures import Equals, Mistake
from exercise_watch import Watch
from helpers import load_lesson

LESSON, NAME = "18_async_tensor_parallel", "all_gather_matmul"
P, N, SEQ, D_IN, D_OUT = 3, 4, 12, 8, 6  # enough rows that MKL multiplies a row alike in a block and whole
ARRIVAL = "Y's blocks in the order they arrived"
NO_BIAS = "X W_r^T without the bias"
OWN = "this rank's own block, P times"
NEIGHBOUR = "the left neighbour's block wherever another rank's belongs (each rank sends its own block every step)"


def _ranks(rt, all_gather_matmul, claims) -> None:
    lesson = load_lesson("async_tensor_parallel")
    gen = torch.Generator().manual_seed(18)
    x = torch.randn(N, SEQ, D_IN, generator=gen, dtype=torch.float64)
    w = torch.randn(D_OUT, D_IN, generator=gen, dtype=torch.float64)
    b = torch.randn(D_OUT, generator=gen, dtype=torch.float64)
    r, blocks = rt.rank, x.chunk(P, dim=1)
    clock = lesson.Clock()
    with Watch() as watch:
        gathered, y = all_gather_matmul(blocks[r].clone(), w, b, None, clock)
    want = F.linear(x, w, b)  # one process: the whole X
    order = [(r - k) % P for k in range(P)]  # whose block this rank holds in step k
    claims.close(
        "Y equals the whole X times W_r^T + b_r",
        y,
        want,
        what="Y",
        tol=1e-15,
        alternatives={
            ARRIVAL: torch.cat([F.linear(blocks[s], w, b) for s in order], dim=1),
            NO_BIAS: F.linear(x, w),
            OWN: torch.cat([F.linear(blocks[r], w, b)] * P, dim=1),
            NEIGHBOUR: torch.cat([F.linear(blocks[r if s == r else (r - 1) % P], w, b) for s in range(P)], dim=1),
        },
    )
    claims.holds("Y equals one process's bit for bit", torch.equal(y, want), what="Y, every bit")
    claims.close("X gathered equals the whole X", gathered, x, what="X", tol=1e-15)
    claims.equal(
        "bytes sent equal (P-1)/P of X",
        watch.sent(P),
        float((P - 1) * x.numel() * 8 // P),
        what="bytes sent (sends as they leave the rank, collectives by the ring formulas)",
    )
    claims.equal(
        "messages in flight under a partial matmul",
        lesson.hidden(clock),
        P - 1,
        what="messages whose flight overlaps a partial matmul (clock.compute) on this rank",
        hints=("post the next block's send and receive before the held block's matmul, wait after it",),
    )


MISTAKES = (
    Mistake(
        "blocks put in the order they arrived",
        "Y equals the whole X",
        (Equals(ARRIVAL),),
        (
            "in step k this rank holds rank (r - k) mod P's block, not block k",
            "write each block's rows where its source rank's rows go: the (r - k) mod P-th chunk along dim 1",
            "y.chunk(P, dim=1)[(r - k) % P].copy_(F.linear(held, weight, bias))",
        ),
    ),
    Mistake(
        "the bias forgotten",
        "Y equals the whole X",
        (Equals(NO_BIAS),),
        (
            "a column-parallel layer owns its outputs' bias: every row of Y gets b_r",
            "add the bias in each partial matmul: every block's rows are rows of Y",
            "F.linear(held, weight, bias)",
        ),
    ),
    Mistake(
        "the received block never used",
        "Y equals the whole X",
        (Equals(OWN),),
        (
            "the messages arrive, but the next step multiplies the block this rank had",
            "after wait(), the received buffer is the block to hold (and to send on) in the next step",
            "(held,) = transfer.wait()",
        ),
    ),
    Mistake(
        "this rank's own block sent every step",
        "Y equals the whole X",
        (Equals(NEIGHBOUR),),
        (
            "a ring passes blocks on: what this rank sends in step k is what it received in step k - 1",
            "every step sends the held block, the one just received, so that block r - k reaches this rank in step k",
            "post [(held, right)], not [(x, right)]: held is replaced by what arrived",
        ),
    ),
)


def _ring(x, weight, bias, group, clock, place, wrong=""):
    r, p = dist.get_rank(group), dist.get_world_size(group)
    held, gathered, y = x.contiguous(), [None] * p, [None] * p
    for k in range(p):
        where = place(r, k, p)
        gathered[where] = held
        if k < p - 1:
            sent = x.contiguous() if wrong == "own sent" else held
            transfer = clock.post(str(k), [(sent, (r + 1) % p)], [(torch.empty_like(held), (r - 1) % p)], group)
        with clock.compute(str(k)):
            y[where] = F.linear(held, weight, None if wrong == "no bias" else bias)
        if k < p - 1:
            (received,) = transfer.wait()
            held = held if wrong == "own block" else received
    return torch.cat(gathered, dim=1), torch.cat(y, dim=1)


def in_arrival_order(x, weight, bias, group=None, clock=None):
    """Step k's block put at position k."""
    return _ring(x, weight, bias, group, clock, lambda r, k, p: k)


def without_bias(x, weight, bias, group=None, clock=None):
    """The ring right, the bias left out."""
    return _ring(x, weight, bias, group, clock, lambda r, k, p: (r - k) % p, "no bias")


def own_block_only(x, weight, bias, group=None, clock=None):
    """The messages go and come, the held block is never replaced."""
    return _ring(x, weight, bias, group, clock, lambda r, k, p: (r - k) % p, "own block")


def own_block_sent(x, weight, bias, group=None, clock=None):
    """The block received is multiplied, but every step sends this rank's own block on."""
    return _ring(x, weight, bias, group, clock, lambda r, k, p: (r - k) % p, "own sent")


def gather_then_multiply(x, weight, bias, group=None, clock=None):
    """Right numbers, right bytes, nothing hidden: torch's all-gather first, then the whole matmul."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    whole = torch.cat(parts, dim=1)
    with clock.compute("*"):
        return whole, F.linear(whole, weight, bias)


def waits_first(x, weight, bias, group=None, clock=None):
    """Right numbers, right bytes: each block received before the held one is multiplied."""
    r, p = dist.get_rank(group), dist.get_world_size(group)
    held, gathered, y = x.contiguous(), [None] * p, [None] * p
    for k in range(p):
        gathered[(r - k) % p] = held
        with clock.compute(str(k)):
            y[(r - k) % p] = F.linear(held, weight, bias)
        if k < p - 1:
            (held,) = clock.post(str(k), [(held, (r + 1) % p)], [(torch.empty_like(held), (r - 1) % p)], group).wait()
    return torch.cat(gathered, dim=1), torch.cat(y, dim=1)


# World sizes: P = 3 only: a ring of three has a block that travels two hops (at P = 2 the neighbour's is the only
# one).
EXERCISE = Exercise(
    LESSON,
    NAME,
    _ranks,
    P,
    MISTAKES,
    hints=(
        "a matmul is row by row: the rows of one block of X need only that block",
        "P steps: hold a block, post its send right and the next block's receive from the left, multiply the held "
        "block into its rows of Y, wait, hold what arrived",
        "source = (r - k) % P; transfer = clock.post(str(source), [(held, (r + 1) % P)], "
        "[(torch.empty_like(held), (r - 1) % P)], group); with clock.compute(str(source)): ...; "
        "(held,) = transfer.wait()",
    ),
    numbers="equal",
)
WRONG = {
    "blocks put in the order they arrived": "in_arrival_order",
    "the bias forgotten": "without_bias",
    "the received block never used": "own_block_only",
    "this rank's own block sent every step": "own_block_sent",
}
test_exercise, test_the_blank_is_not_written_yet, test_the_judge_names_the_mistake = EXERCISE.tests(
    Path(__file__), WRONG
)
test_the_judge_checks_beyond_numbers = EXERCISE.structure_test(
    Path(__file__),
    {"gather_then_multiply": "under a partial matmul", "waits_first": "under a partial matmul"},
)

test_the_judge_rejects_a_planted_slip = EXERCISE.audit_test(Path(__file__))
test_the_judge_rejects_a_second_slip = EXERCISE.audit_test(Path(__file__), second=True)
