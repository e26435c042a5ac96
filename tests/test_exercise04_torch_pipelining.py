"""Exercise 04: this rank's PipelineStage and schedule in torch.distributed.pipelining, judged on 3 ranks:
each rank builds its stage and schedule with the answer, the lesson's TorchStep makes the step calls,
and the lesson's claims are checked for GPipe and 1F1B (M = P = 3, equal micro-batches): the gradients
and parameters equal the unsplit model's on the whole batch (float64, rtol 1e-10), and PyTorch executes
our schedule's order of forwards and backwards on every rank."""

from pathlib import Path

import torch.nn.functional as F
from exercise_kit import Answer, exercise_tests, judge

from distlab.compare import all_ok, compare
from distlab.pipeline.schedules import make_schedule
from distlab.pipeline.torch_engine import TorchStep
from distlab.pipeline.training import PipelineConfig, train, unsplit_reference

LESSON, NAME = "04_torch_pipelining", "pipeline_for_rank"
P, M = 3, 3
CFG = PipelineConfig(
    widths=(4, *[6] * 5, 3), global_batch=6, micro_batches=M, steps=2, lr=0.2, seed=3, gather_spans=False
)


def _ranks(rt, pipeline_for_rank, claims) -> None:
    ref = unsplit_reference(CFG)
    for name in ("gpipe", "1f1b"):
        cfg = CFG.replace(schedule=name)
        run = train(rt, cfg, TorchStep(rt, cfg, pipeline_for_rank))
        grads = compare({n: ref.first_grads[n] for n in run.first_grads}, run.first_grads)
        ratio = max(r.max_abs for r in grads) / max(ref.first_grads[n].abs().max().item() for n in run.first_grads)
        claims.check(
            f"{name}: the gradients and parameters equal the unsplit model's",
            all_ok(grads) and all_ok(compare({n: ref.params[n] for n in run.params}, run.params)),
            f"largest gradient error {ratio:.2f} of the largest gradient",
            "keep scale_grads=True (the default): it divides the M micro-batch means' gradients by M",
        )
        want = make_schedule(name, P, M)[rt.rank]
        claims.check(
            f"{name}: PyTorch executes our order",
            run.executed == want,
            f"ran {' '.join(map(str, run.executed))}, ours {' '.join(map(str, want))}",
            "gpipe is pipelining.ScheduleGPipe, 1f1b pipelining.Schedule1F1B",
        )


def check(answer: Answer) -> None:
    judge(_ranks, P, answer)


def unscaled(module, p, num_ranks, device, name, microbatches):
    """A wrong answer: scale_grads=False with a mean loss, M times the gradient."""
    from torch.distributed import pipelining

    stage = pipelining.PipelineStage(module, p, num_ranks, device)
    schedule_class = {"gpipe": pipelining.ScheduleGPipe, "1f1b": pipelining.Schedule1F1B}[name]
    return stage, schedule_class(stage, microbatches, loss_fn=F.mse_loss, scale_grads=False)


test_exercise, test_the_judge_rejects_a_blank_and_a_wrong_answer = exercise_tests(
    LESSON,
    NAME,
    check,
    wrong=Answer(Path(__file__), "unscaled"),
    wrong_claim="gpipe: the gradients and parameters equal the unsplit model's",
)
