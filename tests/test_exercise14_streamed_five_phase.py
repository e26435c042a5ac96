"""Exercise 14: the streamed five-phase step, judged on P = 2 ranks with dropout on and a learned scale.

The reference is plain autograd on the whole global batch in each rank's process (a deep copy), each rank's
micro-batches replayed from its own random stream (`as_ranks` with the step's own cut, cfg.micro). The
lesson's claims: the loss equals the reference's, and every parameter's gradient does, the logit scale's
included (float64, rtol 1e-10), with micro-batches (3, 3) and tiles of 5 that divide nothing."""

import copy
import math
from pathlib import Path

import torch
from exercise_kit import Answer, exercise_tests, judge, solution
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distlab.compare import all_ok, compare, grads_of
from distlab.contrastive.reference import RankStreams, as_ranks, full_batch_gradients
from distlab.models import TwoTower, paired_data
from distlab.streamed.config import parse_config

LESSON, NAME = "14_streamed_five_phase", "streamed_backward"
P, SEED = 2, 5
CONFIG = {"GLOBAL_BATCH_SIZE": 12, "MICRO_BATCH_SIZE": 4, "STREAM_CHUNK_SIZE": 5}  # C = 6: parts 3, 3


class Scaled(TwoTower):
    """Two towers with dropout and a learned logit scale returned third (open_clip's way)."""

    def __init__(self):
        super().__init__(dropout=0.3, seed=1, dtype=torch.float64)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(10.0), dtype=torch.float64))

    def forward(self, x, y):
        return (*super().forward(x, y), self.logit_scale.exp())


def _ranks(rt, streamed_backward, claims) -> None:
    cfg, model = parse_config(CONFIG, rt.world_size, rt.rank), Scaled()
    x, y = paired_data(cfg.n, seed=2, dtype=torch.float64)
    start, ddp, mine = copy.deepcopy(model), DDP(model), slice(cfg.offset, cfg.offset + cfg.local)
    torch.manual_seed(SEED + rt.rank)  # each rank its own dropout stream
    loss = streamed_backward(ddp, x[mine], y[mine], cfg, None)
    streams = RankStreams([SEED + r for r in range(rt.world_size)])
    ref_loss, ref = full_batch_gradients(start, x, y, None, forward=as_ranks(streams, cfg.micro))
    claims.check(
        "the loss equals the whole batch's",
        math.isclose(float(loss), ref_loss, rel_tol=1e-10),
        f"{float(loss):.12f} vs {ref_loss:.12f}",
        "L = 1/(2N) sum_i (a_i + b_i - 2 S_ii) over all N rows",
    )
    rows = compare(ref, grads_of(model))
    worst = max(rows, key=lambda r: r.max_rel)
    claims.check(
        "every parameter's gradient equals the whole batch's",
        all_ok(rows),
        f"{worst.name}: relative error {worst.max_rel:.2e}",
        "DDP averages over P ranks: back-propagate P times G; replay each micro-batch's random state",
    )


def check(answer: Answer) -> None:
    judge(_ranks, P, answer)


def without_p(ddp, local_x, local_y, cfg, tau):
    """A wrong answer: the VJP of G without the factor P, so DDP's average leaves 1/P of the gradient."""
    loss = solution(LESSON, NAME).load()(ddp, local_x, local_y, cfg, tau)
    for p in ddp.parameters():
        p.grad.div_(cfg.world)
    return loss


test_exercise, test_the_judge_rejects_a_blank_and_a_wrong_answer = exercise_tests(
    LESSON, NAME, check, wrong=Answer(Path(__file__), "without_p"), wrong_claim="every parameter's gradient equals"
)
