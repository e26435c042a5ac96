"""Exercise 12: the sum-backward all-gather, judged on 3 ranks against one process on the whole batch.

Each rank gathers its C rows of Z_x and Z_y with the answer, computes its own C rows of the symmetric
InfoNCE (`local_clip_loss`) and back-propagates. The lesson's claims: the gathered Z equals every rank's
block in order; the gradient at each rank's embeddings equals P times the full-batch gradient there (each
rank's loss is a mean over its C rows, and sum_s L_s = P L), the factor DDP's average then removes."""

from pathlib import Path

import torch
from exercise_kit import Answer, Embeddings, exercise_tests, judge

from distlab.contrastive.gather import gather_plain
from distlab.contrastive.losses import clip_loss, local_clip_loss

LESSON, NAME = "12_contrastive_allgather_fix", "gather_all_reduce"
P, C, D, TAU = 3, 4, 5, 0.1


def _ranks(rt, gather, claims, seed: int) -> None:
    e = Embeddings.of(rt.rank, P, C, D, seed)
    full_x, rows, z_x, z_y = e.full_x, e.rows, e.z_x, e.z_y
    all_x, all_y = gather(z_x), gather(z_y)
    claims.check(
        "the forward gathers every rank's block in rank order",
        torch.equal(all_x.detach(), full_x),
        f"max difference {(all_x.detach() - full_x).abs().max():.1e}",
        "all_gather_single puts rank r's C rows at r C .. r C + C - 1",
    )
    local_clip_loss(z_x, z_y, all_x, all_y, 1 / TAU, rt.rank * C).backward()
    ref_x, ref_y = e.whole()
    clip_loss(ref_x, ref_y, 1 / TAU).backward()
    for name, got, want in (("z_x", z_x.grad, P * ref_x.grad[rows]), ("z_y", z_y.grad, P * ref_y.grad[rows])):
        err = ((got - want).norm() / want.norm()).item() if got is not None else float("inf")
        claims.check(
            f"the gradient at {name} equals P x the full batch's",
            err < 1e-10,
            f"relative error {err:.2e}" if got is not None else "no gradient reached it",
            "backward must all_reduce(SUM) the N x d gradient over ranks, then return your C rows",
        )


def check(answer: Answer) -> None:
    judge(_ranks, P, answer, 0)


# A wrong answer: the plain gather (lesson 11's), whose backward keeps only this rank's own loss's term.
plain_gather = gather_plain


test_exercise, test_the_judge_rejects_a_blank_and_a_wrong_answer = exercise_tests(
    LESSON,
    NAME,
    check,
    wrong=Answer(Path(__file__), "plain_gather"),
    wrong_claim="the gradient at z_x equals P x the full batch's",
)
