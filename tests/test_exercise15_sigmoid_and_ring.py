"""Exercise 15: the sigmoid ring by hand, judged on 3 ranks against one process on the whole batch.

Each rank passes its C x d image and text embeddings to the answer. The lesson's claims: G_x for its rows
and G_y for its pairs equal plain autograd of the sigmoid loss on the whole batch (float64), and the bytes
it sent equal (P - 1) C d + P C d elements."""

from pathlib import Path

import torch
import torch.distributed as dist
from exercise_kit import Answer, Embeddings, exercise_tests, judge

from distlab.contrastive.losses import sigmoid_loss

LESSON, NAME = "15_sigmoid_and_ring", "ring_by_hand"
P, C, D, S, BETA = 3, 4, 5, 10.0, -10.0


def _ranks(rt, ring, claims, seed: int) -> None:
    e = Embeddings.of(rt.rank, P, C, D, seed)
    rows = e.rows
    g_x, g_y, sent = ring(rt, e.z_x.detach().clone(), e.z_y.detach().clone(), S, BETA)
    ref_x, ref_y = e.whole()
    sigmoid_loss(ref_x, ref_y, S, BETA).backward()  # plain autograd on the whole batch
    for name, got, want in (("G_x", g_x, ref_x.grad[rows]), ("G_y", g_y, ref_y.grad[rows])):
        err = ((got - want).norm() / want.norm()).item()
        claims.check(
            f"{name} equals the whole batch's on my rows",
            err < 1e-10,
            f"relative error {err:.2e}",
            "D = -(1/N) eps sigma(-eps S) with N = P C, eps's +1s only in the block j = r; "
            "G_y comes home after P hops of the accumulator",
        )
    want = 8 * ((P - 1) * C * D + P * C * D)
    claims.check(
        "the bytes sent equal (P-1) C d + P C d elements",
        sent == want,
        f"sent {sent}, formula {want}",
        "count every tensor you isend: P - 1 text blocks and P accumulators",
    )


def check(answer: Answer) -> None:
    judge(_ranks, P, answer, 0)


def gathered_ring(rt, x, y, s, beta):
    """A wrong answer: G_y for my pairs from my own rows only (no traveling accumulator: the other
    ranks' rows' share of G_y is lost), with G_x right via an all-gather."""
    every = torch.empty(P * C, D, dtype=x.dtype)
    dist.all_gather_into_tensor(every, y.contiguous())
    eps = -torch.ones(C, P * C, dtype=x.dtype)
    eps[:, rt.rank * C : (rt.rank + 1) * C] += 2 * torch.eye(C, dtype=x.dtype)
    d = -eps * torch.sigmoid(-eps * (s * x @ every.T + beta)) / (P * C)
    mine = slice(rt.rank * C, (rt.rank + 1) * C)
    return s * d @ every, s * d[:, mine].T @ x, (P - 1) * y.nbytes


test_exercise, test_the_judge_rejects_a_blank_and_a_wrong_answer = exercise_tests(
    LESSON,
    NAME,
    check,
    wrong=Answer(Path(__file__), "gathered_ring"),
    wrong_claim="G_y equals the whole batch's on my rows",
)
