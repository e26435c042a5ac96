"""Exercise 21: back-propagating P * L, judged on 3 ranks against one process on the whole batch.

Each rank gathers its C rows of Z_x and Z_y with the plain gather (its own block keeps its graph), calls the
answer and back-propagates what it returns. The lesson's claims: the loss it reports equals the full
batch's L, and the gradient at each rank's embeddings equals P times the full-batch gradient there, the
factor DDP's average then removes (so the parameters get exactly dL/dtheta)."""

from pathlib import Path

import torch
import torch.nn.functional as F
from exercise_kit import Embeddings, Exercise
from exercise_signatures import Equals, Mistake, Scaled

from distlab.contrastive.gather import gather_plain
from distlab.contrastive.losses import clip_loss

LESSON, NAME = "contrastive_global", "global_loss_times_p"
P, C, D, TAU = 3, 4, 5, 0.1
HALF, AT_TAU = "the image-to-text half of L alone", "L at logit scale tau instead of 1/tau"
MOVED = "P L, with L back-propagated: the gradient at z_x is 1/P of the claim's (the full batch's, not P times it)"


def _ranks(rt, loss_fn, claims, seed: int) -> None:
    e = Embeddings.of(rt.rank, P, C, D, seed)
    rows, z_x = e.rows, e.z_x
    loss, value = loss_fn(rt, z_x, e.z_y, TAU, gather_plain)
    ref_x, ref_y = e.whole()
    ref = clip_loss(ref_x, ref_y, 1 / TAU)  # clip_loss takes the logit scale s = 1/tau
    ref.backward()
    labels = torch.arange(P * C)
    loss.backward()
    # which factor the back-propagated loss carried, read off the gradient: offered as a reading of the value
    # reported only where the gradient is the full batch's itself (the P put on the value, not the loss)
    bare = z_x.grad is not None and torch.allclose(z_x.grad, ref_x.grad[rows], rtol=1e-9, atol=1e-12)
    claims.equal(
        "the reported loss is the full batch's L",
        float(value),
        ref.item(),
        ok=abs(float(value) - ref.item()) < 1e-12,
        what="the reported loss",
        alternatives={
            HALF: F.cross_entropy(e.full_x @ e.full_y.T / TAU, labels).item(),
            AT_TAU: clip_loss(e.full_x, e.full_y, TAU).item(),
            **({MOVED: P * ref.item()} if bare else {}),
        },
    )
    claims.close("the gradient at z_x equals P x the full batch's", z_x.grad, P * ref_x.grad[rows], what="dL/dz_x")


MISTAKES = (
    Mistake(
        "P put on the reported value, not on the loss back-propagated",
        "reported loss",
        (Equals(MOVED),),
        (
            "the factor P went on the wrong output: the value reported is P x L, the gradient 1/P of what DDP needs",
            "back-propagate P L (DDP's average divides it by P again) and report L itself",
            "return (P * L, L.detach()), not (L, P * L.detach())",
        ),
        fails=("gradient at z_x",),
    ),
    Mistake(
        "L back-propagated, not P L",
        "gradient at z_x",
        (Scaled("1/P", lambda p: 1 / p),),
        (
            "DDP averages the ranks' gradients, and each rank's backward reaches only its own block",
            "the average of the P partial gradients g_r is dL/dtheta / P: scale what you back-propagate to undo it",
            "return (rt.world_size * loss, loss.detach())",
        ),
        holds=("reported loss",),
    ),
    Mistake(
        "P L reported as the loss",
        "reported loss",
        (Scaled("P", lambda p: p),),
        (
            "the value you report is for reading: the global loss L itself",
            "the factor P belongs only to what is back-propagated",
            "return (P * L, L.detach()), not (P * L, (P * L).detach())",
        ),
    ),
    Mistake(
        "one direction of the symmetric loss",
        "reported loss",
        (Equals(HALF),),
        (
            "CLIP's loss is symmetric: each image picks its text and each text picks its image",
            "L = (cross-entropy over the rows of S + cross-entropy over its columns) / 2",
            "average F.cross_entropy(S, labels) and F.cross_entropy(S.T, labels), S = Z_x Z_y^T / tau",
        ),
    ),
    Mistake(
        "tau taken for the logit scale",
        "reported loss",
        (Equals(AT_TAU),),
        (
            "the temperature divides the logits; the logit scale s = 1 / tau multiplies them",
            "S = s Z_x Z_y^T with s = 1 / tau",
            "pass 1 / tau where a loss takes the logit scale",
        ),
    ),
)


def moved_p(rt, z_x, z_y, tau, gather):
    """The factor P on the value reported, L itself back-propagated."""
    loss = clip_loss(gather(z_x), gather(z_y), 1 / tau)
    return loss, rt.world_size * loss.detach()


def plain_loss(rt, z_x, z_y, tau, gather):
    """L back-propagated as it is, which DDP's average turns into dL/dtheta / P."""
    loss = clip_loss(gather(z_x), gather(z_y), 1 / tau)
    return loss, loss.detach()


def reports_p_l(rt, z_x, z_y, tau, gather):
    """The right gradient, but P L reported."""
    loss = rt.world_size * clip_loss(gather(z_x), gather(z_y), 1 / tau)
    return loss, loss.detach()


def one_direction(rt, z_x, z_y, tau, gather):
    """Images pick their texts; the texts' half of the symmetric loss is missing."""
    logits = gather(z_x) @ gather(z_y).T / tau
    loss = F.cross_entropy(logits, torch.arange(len(logits)))
    return rt.world_size * loss, loss.detach()


def scale_tau(rt, z_x, z_y, tau, gather):
    """tau passed where the logit scale goes: logits multiplied by tau, not divided."""
    loss = clip_loss(gather(z_x), gather(z_y), tau)
    return rt.world_size * loss, loss.detach()


# World sizes: P = 3 only: P L against L and N L: C = 4 != P = 3 keeps the factors apart.
EXERCISE = Exercise(
    LESSON,
    NAME,
    _ranks,
    P,
    MISTAKES,
    hints=(
        "every rank can compute the whole L from the gathered embeddings; the question is what DDP does next",
        "DDP averages over P ranks, and each rank's graph reaches only its own C rows of Z",
        "loss = clip_loss(gather(z_x), gather(z_y), 1 / tau); return P * loss, loss.detach()",
    ),
    args=(0,),
    quantities=lambda p: {"C": C, "N": p * C},
)
WRONG = {
    "P put on the reported value, not on the loss back-propagated": "moved_p",
    "L back-propagated, not P L": "plain_loss",
    "P L reported as the loss": "reports_p_l",
    "one direction of the symmetric loss": "one_direction",
    "tau taken for the logit scale": "scale_tau",
}
test_exercise, test_the_blank_is_not_written_yet, test_the_judge_names_the_mistake = EXERCISE.tests(
    Path(__file__), WRONG
)

test_the_judge_rejects_a_planted_slip = EXERCISE.audit_test(Path(__file__))
test_the_judge_rejects_a_second_slip = EXERCISE.audit_test(Path(__file__), second=True)
