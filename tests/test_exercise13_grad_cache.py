"""Exercise 13: GradCache's three steps, judged on one rank (the lesson's part 1) with dropout on.

The reference is plain autograd on the whole batch with the very dropout masks the answer's first pass
draws: the same seed, the towers run on the same parts in the same order, with a graph. The lesson's
claims: the loss equals the reference's, and every parameter's gradient does (float64, rtol 1e-10), with
parts of b = 3 rows that do not divide n = 8."""

from pathlib import Path

import torch
import torch.nn.functional as F
from exercise_kit import Answer, exercise_tests, judge

from distlab.contrastive.losses import clip_loss
from distlab.models import TwoTower, paired_data

LESSON, NAME = "13_grad_cache", "grad_cache_step"
N, B, TAU, SEED = 8, 3, 0.1, 7


def _loss(rep_x, rep_y):
    return clip_loss(F.normalize(rep_x, dim=-1), F.normalize(rep_y, dim=-1), 1 / TAU)


def _ranks(rt, grad_cache_step, claims) -> None:
    model, ref = TwoTower(dropout=0.3, seed=1), TwoTower(dropout=0.3, seed=1)
    x, y = paired_data(N, seed=2)
    torch.manual_seed(SEED)
    loss = grad_cache_step([model.encoder_x, model.encoder_y], (x, y), B, _loss)
    torch.manual_seed(SEED)  # the same masks, drawn in the same order
    reps = [
        torch.cat([tower(part) for part in inp.split(B)]) for tower, inp in ((ref.encoder_x, x), (ref.encoder_y, y))
    ]
    ref_loss = _loss(*reps)
    ref_loss.backward()
    claims.check(
        "the loss equals the whole batch's",
        abs(float(loss) - ref_loss.item()) < 1e-10,
        f"{float(loss):.12f} vs {ref_loss.item():.12f}",
        "step (2) is the loss on all n rows at once",
    )
    errs = {
        name: float("inf") if p.grad is None else ((p.grad - q.grad).norm() / q.grad.norm()).item()
        for (name, p), q in zip(model.named_parameters(), ref.parameters())
    }
    claims.check_worst(
        "every parameter's gradient equals the whole batch's",
        errs,
        "step (3) must run each part under the random state step (1) recorded (RandContext)",
    )


def check(answer: Answer) -> None:
    judge(_ranks, 1, answer)


def without_replay(towers, inputs, b, loss_fn):
    """A wrong answer: step (3) draws new dropout masks instead of replaying step (1)'s."""
    with torch.no_grad():
        reps = [torch.cat([tower(part) for part in x.split(b)]) for tower, x in zip(towers, inputs)]
    leaves = [r.requires_grad_() for r in reps]
    loss = loss_fn(*leaves)
    loss.backward()
    for tower, x, leaf in zip(towers, inputs, leaves):
        for part, g in zip(x.split(b), leaf.grad.split(b)):
            torch.dot(tower(part).flatten(), g.flatten()).backward()
    return loss.detach()


test_exercise, test_the_judge_rejects_a_blank_and_a_wrong_answer = exercise_tests(
    LESSON, NAME, check, wrong=Answer(Path(__file__), "without_replay"), wrong_claim="every parameter's gradient equals"
)
