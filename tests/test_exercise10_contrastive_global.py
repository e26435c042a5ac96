"""Exercise 10: back-propagating P * L, judged on 3 ranks against one process on the whole batch.

Each rank gathers its C rows of Z_x and Z_y with the plain gather (its own block keeps its graph), calls the
answer and back-propagates what it returns. The lesson's claims: the loss it reports equals the full
batch's L, and the gradient at each rank's embeddings equals P times the full-batch gradient there, the
factor DDP's average then removes (so the parameters get exactly dL/dtheta)."""

from pathlib import Path

from exercise_kit import Answer, Embeddings, exercise_tests, judge

from distlab.contrastive.gather import gather_plain
from distlab.contrastive.losses import clip_loss

LESSON, NAME = "10_contrastive_global", "global_loss_times_p"
P, C, D, TAU = 3, 4, 5, 0.1


def _ranks(rt, loss_fn, claims, seed: int) -> None:
    e = Embeddings.of(rt.rank, P, C, D, seed)
    rows, z_x, z_y = e.rows, e.z_x, e.z_y
    loss, value = loss_fn(rt, z_x, z_y, TAU, gather_plain)
    ref_x, ref_y = e.whole()
    ref = clip_loss(ref_x, ref_y, 1 / TAU)  # clip_loss takes the logit scale s = 1/tau
    ref.backward()
    claims.check(
        "the reported loss is the full batch's L",
        abs(float(value) - ref.item()) < 1e-12,
        f"{float(value):.12f} against {ref.item():.12f}",
        "report L itself, not P * L",
    )
    loss.backward()
    err = ((z_x.grad - P * ref_x.grad[rows]).norm() / (P * ref_x.grad[rows]).norm()).item()
    claims.check(
        "the gradient at z_x equals P x the full batch's",
        err < 1e-10,
        f"relative error {err:.2e}",
        "back-propagate P * L: DDP's average of the P ranks' gradients then gives dL/dtheta",
    )


def check(answer: Answer) -> None:
    judge(_ranks, P, answer, 0)


def plain_loss(rt, z_x, z_y, tau, gather):
    """A wrong answer: L back-propagated as it is, which DDP's average turns into dL/dtheta / P."""
    loss = clip_loss(gather(z_x), gather(z_y), 1 / tau)
    return loss, loss.detach()


test_exercise, test_the_judge_rejects_a_blank_and_a_wrong_answer = exercise_tests(
    LESSON,
    NAME,
    check,
    wrong=Answer(Path(__file__), "plain_loss"),
    wrong_claim="the gradient at z_x equals P x the full batch's",
)
