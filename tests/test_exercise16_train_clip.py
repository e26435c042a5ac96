"""Exercise 16: one step of CLIP training with distributed_backward, judged on 2 ranks.

A small DigitsCLIP (float64, learned scale) under DDP takes one step of the answer on each rank's C rows
(micro-batches of B < C: the recompute path) with SGD and a tight clipping norm; the reference is a deep
copy stepped in one process: plain autograd on clip_loss over the whole batch, the same clipping, SGD and
clamp. The lesson's claims: the loss is the whole batch's, and every parameter after the step, the logit
scale included, equals the reference's (float64, rtol 1e-10)."""

import copy
from pathlib import Path

import torch
from exercise_kit import Answer, exercise_tests, judge
from torch.nn.parallel import DistributedDataParallel as DDP

from distlab.contrastive.digits import DigitsCLIP
from distlab.contrastive.losses import clip_loss
from distributed_clip import distributed_backward

LESSON, NAME = "16_train_clip", "clip_step"
P, C, VOCAB, LENGTH, LR, CLIP_NORM = 2, 4, 12, 5, 0.5, 1e-2
CONFIG = {"GLOBAL_BATCH_SIZE": P * C, "MICRO_BATCH_SIZE": 3, "STREAM_CHUNK_SIZE": 3}


def _ranks(rt, clip_step, claims) -> None:
    gen = torch.Generator().manual_seed(5)
    images = torch.randn(P * C, 1, 8, 8, generator=gen, dtype=torch.float64)
    ids = torch.randint(1, VOCAB, (P * C, LENGTH), generator=gen)
    model = DigitsCLIP(VOCAB, LENGTH, dim=8, width=4, seed=1).double()
    ref = copy.deepcopy(model)
    ddp = DDP(model)
    rows = slice(rt.rank * C, (rt.rank + 1) * C)
    loss = clip_step(ddp, torch.optim.SGD(ddp.parameters(), lr=LR), images[rows], ids[rows], CONFIG, CLIP_NORM)
    ref_loss = clip_loss(*ref(images, ids))  # z_x, z_y, s: the whole batch
    ref_loss.backward()
    torch.nn.utils.clip_grad_norm_(list(ref.parameters()), CLIP_NORM)
    torch.optim.SGD(ref.parameters(), lr=LR).step()
    ref.clamp_logit_scale_()
    claims.check(
        "the loss is the whole batch's",
        abs(float(loss) - ref_loss.item()) < 1e-10,
        f"{float(loss):.12f} vs {ref_loss.item():.12f}",
        "return what distributed_backward returns",
    )
    errs = {
        n: ((p - q).abs().max() / q.abs().max()).item() for (n, p), q in zip(model.named_parameters(), ref.parameters())
    }
    claims.check_worst(
        "every parameter after the step equals one process's",
        errs,
        "zero_grad, distributed_backward, clip_grad_norm_ at clip_norm, step, then clamp the scale",
    )


def check(answer: Answer) -> None:
    judge(_ranks, P, answer)


def without_clipping(ddp, optimizer, images, captions, config, clip_norm, bf16=False):
    """A wrong answer: the step without clipping the gradient's norm."""
    optimizer.zero_grad(set_to_none=True)
    loss = distributed_backward(ddp, images, captions, config)
    optimizer.step()
    ddp.module.clamp_logit_scale_()
    return loss


test_exercise, test_the_judge_rejects_a_blank_and_a_wrong_answer = exercise_tests(
    LESSON, NAME, check, wrong=Answer(Path(__file__), "without_clipping"), wrong_claim="every parameter after the step"
)
