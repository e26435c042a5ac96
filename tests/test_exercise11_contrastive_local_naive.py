"""Exercise 11: a rank's local x global loss, judged on 3 ranks with the plain all-gather of lesson 11.

The reference is one process on the whole N x N logits: rank r's rows of the symmetric loss picked out of
S = s Z_x Z_y^T (its rows i and its columns i, for r's pairs). The lesson's claims: each rank's loss is its
rows' share; their mean is the full-batch loss (the loss is exact); and the plain gather's gradient is
the gradient of the rank's own L_r alone, what lesson 11 shows is not the full batch's."""

from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from exercise_kit import ROOT, Answer, Embeddings, exercise_tests, judge

from distlab.contrastive.gather import gather_plain
from distlab.contrastive.losses import clip_loss

LESSON, NAME = "11_contrastive_local_naive", "local_clip_loss"
P, C, D, S = 3, 4, 5, 10.0


def _rows_loss(z_x, z_y, rows: slice) -> torch.Tensor:
    """Rank r's L_r read off the whole N x N logits (one process)."""
    logits = S * z_x @ z_y.T
    nll_rows = -torch.log_softmax(logits, 1).diagonal()[rows]
    nll_cols = -torch.log_softmax(logits, 0).diagonal()[rows]
    return (nll_rows.mean() + nll_cols.mean()) / 2


def _ranks(rt, local_clip_loss, claims) -> None:
    e = Embeddings.of(rt.rank, P, C, D, 3)
    full_x, full_y, rows, z_x, z_y = e.full_x, e.full_y, e.rows, e.z_x, e.z_y
    loss = local_clip_loss(z_x, z_y, gather_plain(z_x), gather_plain(z_y), S, rt.rank * C)
    ref_x, ref_y = e.whole()
    ref = _rows_loss(ref_x, ref_y, rows)
    claims.check(
        "your loss is rank r's rows of the symmetric loss",
        abs(loss.item() - ref.item()) < 1e-10,
        f"{loss.item():.12f} vs {ref.item():.12f}",
        "the positive of local row i is global column offset + i",
    )
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    whole = clip_loss(full_x, full_y, S).item()
    claims.check(
        "the mean over ranks equals the full-batch loss",
        abs(mean.item() / P - whole) < 1e-10,
        f"{mean.item() / P:.12f} vs {whole:.12f}",
        "average over your C rows, both directions, / 2",
    )
    loss.backward()
    ref.backward()
    for name, got, want in (("z_x", z_x.grad, ref_x.grad[rows]), ("z_y", z_y.grad, ref_y.grad[rows])):
        err = ((got - want).norm() / want.norm()).item()
        claims.check(
            f"the plain gather's gradient at {name} is dL_r/d{name} alone",
            err < 1e-10,
            f"relative error {err:.2e}",
            "build the logits from the gathered tensors you are given",
        )


def check(answer: Answer) -> None:
    judge(_ranks, P, answer)


def labels_without_offset(local_z_x, local_z_y, all_z_x, all_z_y, s, offset):
    """A wrong answer: every rank's positives at columns 0 .. C-1 (rank 0's pairs)."""
    labels = torch.arange(len(local_z_x))
    return (F.cross_entropy(s * local_z_x @ all_z_y.T, labels) + F.cross_entropy(s * local_z_y @ all_z_x.T, labels)) / 2


test_exercise, test_the_judge_rejects_a_blank_and_a_wrong_answer = exercise_tests(
    LESSON,
    NAME,
    check,
    wrong=Answer(Path(__file__), "labels_without_offset"),
    wrong_claim="rank r's rows",
    solution_at=Answer(ROOT / "src/distlab/contrastive/losses.py", NAME),
)
