"""Exercise 04: this rank's PipelineStage and schedule in torch.distributed.pipelining, judged on 3 ranks: each rank
builds its stage and schedule with the answer (first checked: the stage is stage p of P, its stage_index and
num_stages, before any step runs), the lesson's TorchStep makes the step calls (recorded as the answer's: what each
rank's answer ran lists torch's sends and receives), and the lesson's claims are checked for GPipe and 1F1B (P = 3,
M = 4 equal micro-batches of 3 rows): the gradients after step 1 and the parameters after step 2 equal the unsplit
model's on the whole batch (float64, rtol 1e-10), and PyTorch executes our schedule's order of forwards and
backwards on every rank."""

from pathlib import Path

import torch.nn.functional as F
from exercise_kit import Exercise
from exercise_signatures import Equals, Mistake, Scaled

from distlab.model_split.schedules import make_schedule
from distlab.model_split.torch_engine import TorchStep
from distlab.model_split.training import PipelineConfig, train, unsplit_reference

LESSON, NAME = "torch_pipelining", "pipeline_for_rank"
P, M = 3, 4
CFG = PipelineConfig(
    widths=(4, *[6] * 5, 3), global_batch=12, micro_batches=M, steps=2, lr=0.2, seed=3, gather_spans=False
)
ROWS_OUT = CFG.global_batch // M * CFG.widths[-1]  # one micro-batch's elements: a sum loss's factor
OTHER, OVER_P = "the other schedule's order", "our order over P micro-batches"


def _ranks(rt, pipeline_for_rank, claims) -> None:
    ref = unsplit_reference(CFG)
    for name, other in (("gpipe", "1f1b"), ("1f1b", "gpipe")):
        cfg, built = CFG.replace(schedule=name), []

        def build(*args, built=built):
            stage, schedule = pipeline_for_rank(*args)
            built.append(stage)
            return stage, schedule

        step = TorchStep(rt, cfg, build)
        index, count = (getattr(built[0], key, None) for key in ("stage_index", "num_stages"))
        if not claims.equal(
            f"{name}: rank p builds stage p of P",
            f"stage_index {index}, num_stages {count}",
            f"stage_index {rt.rank}, num_stages {P}",
            what="the PipelineStage this rank built",
            hints=(
                "PipelineStage(module, stage_index, num_stages, device): this rank's stage p of the P ranks' stages",
            ),
        ):
            return  # a stage built wrong leaves torch's engine waiting for a message no rank sends
        _record_steps(step.schedule, getattr(pipeline_for_rank, "ran", None))
        run = train(rt, cfg, step)
        claims.tensors(
            f"{name}: the gradients equal the unsplit model's",
            run.first_grads,
            {n: ref.first_grads[n] for n in run.first_grads},
            what="dL/dtheta_p",
        )
        claims.tensors(
            f"{name}: the parameters after 2 steps equal the unsplit model's",
            run.params,
            {n: ref.params[n] for n in run.params},
            what="theta_p",
        )
        claims.equal(
            f"{name}: PyTorch executes our order",
            list(map(str, run.executed)),
            list(map(str, make_schedule(name, P, M)[rt.rank])),
            what="the order executed",
            alternatives={
                OTHER: list(map(str, make_schedule(other, P, M)[rt.rank])),
                OVER_P: list(map(str, make_schedule(name, P, P)[rt.rank])),
            },
        )


def _record_steps(schedule, ran) -> None:
    """The schedule the answer returned, its steps recorded as the answer's (`ran`: what the answer runs is
    listed in words): torch's sends and receives are its doing, the loss shared after them the judge's."""
    if ran is None:
        return
    step = schedule.step

    def recorded(*args, **kwargs):
        with ran:
            return step(*args, **kwargs)

    schedule.step = recorded


MISTAKES = (
    Mistake(
        "scale_grads turned off",
        "gradients equal",
        (Scaled("M", lambda p: M),),
        (
            "every gradient is M times the reference's: the micro-batches' gradients were added, not averaged",
            "PyTorch back-propagates each micro-batch's mean loss; its scale_grads divides their sum by M",
            "leave scale_grads at its default (True) with a mean loss",
        ),
    ),
    Mistake(
        "a summed loss",
        "gradients equal",
        (Scaled("N/M d_out", lambda p: ROWS_OUT),),
        (
            "every gradient is one micro-batch's element count times the reference's",
            "each micro-batch's loss must be a mean, like the unsplit model's",
            "loss_fn=F.mse_loss (reduction 'mean')",
        ),
    ),
    Mistake(
        "the schedules swapped",
        "executes our order",
        (Equals(OTHER),),
        (
            "the gradients are right, the order is the other schedule's",
            "'gpipe' is PyTorch's GPipe schedule class, '1f1b' its 1F1B class",
            "{'gpipe': pipelining.ScheduleGPipe, '1f1b': pipelining.Schedule1F1B}[name]",
        ),
    ),
    Mistake(
        "P micro-batches instead of M",
        "executes our order",
        (Equals(OVER_P),),
        (
            "PyTorch ran as many micro-batches as there are ranks",
            "the schedule's second argument is the number of micro-batches, M",
            "schedule_class(stage, microbatches, loss_fn=...)",
        ),
    ),
)


def _built(stage_args: tuple, kind: str, m: int, **schedule_options):
    """PipelineStage(*stage_args) and torch's schedule `kind` over m micro-batches built on it."""
    from torch.distributed import pipelining

    stage = pipelining.PipelineStage(*stage_args)
    classes = {"gpipe": pipelining.ScheduleGPipe, "1f1b": pipelining.Schedule1F1B}
    return stage, classes[kind](stage, m, **schedule_options)


def unscaled(module, p, num_ranks, device, name, microbatches):
    """scale_grads=False with a mean loss: M times the gradient."""
    return _built((module, p, num_ranks, device), name, microbatches, loss_fn=F.mse_loss, scale_grads=False)


def summed_loss(module, p, num_ranks, device, name, microbatches):
    """Each micro-batch's loss a sum over its elements."""
    loss = lambda out, target: F.mse_loss(out, target, reduction="sum")  # noqa: E731
    return _built((module, p, num_ranks, device), name, microbatches, loss_fn=loss)


def swapped_classes(module, p, num_ranks, device, name, microbatches):
    """Right numbers, the other schedule: "gpipe" built as 1F1B and "1f1b" as GPipe."""
    other = {"gpipe": "1f1b", "1f1b": "gpipe"}[name]
    return _built((module, p, num_ranks, device), other, microbatches, loss_fn=F.mse_loss)


def ranks_as_microbatches(module, p, num_ranks, device, name, microbatches):
    """num_ranks passed where the number of micro-batches goes."""
    return _built((module, p, num_ranks, device), name, num_ranks, loss_fn=F.mse_loss)


# World sizes: P = 3 only: torch runs the schedule; M = 4 != P = 3 keeps the factor 1/M and the stage count apart.
EXERCISE = Exercise(
    LESSON,
    NAME,
    _ranks,
    P,
    MISTAKES,
    hints=(
        "PyTorch's engine wants two objects per rank: the stage it runs and the schedule that drives it",
        "wrap the module as stage p of P, then build the named schedule over M micro-batches with a mean loss",
        "stage = pipelining.PipelineStage(module, p, num_ranks, device); return stage, "
        "pipelining.ScheduleGPipe(stage, microbatches, loss_fn=F.mse_loss) (or Schedule1F1B)",
    ),
    numbers="equal",
    quantities=lambda p: {"M": M},
)
WRONG = {
    "scale_grads turned off": "unscaled",
    "a summed loss": "summed_loss",
    "the schedules swapped": "swapped_classes",
    "P micro-batches instead of M": "ranks_as_microbatches",
}
test_exercise, test_the_blank_is_not_written_yet, test_the_judge_names_the_mistake = EXERCISE.tests(
    Path(__file__), WRONG
)
test_the_judge_checks_beyond_numbers = EXERCISE.structure_test(Path(__file__), {"swapped_classes": "order"})

test_the_judge_rejects_a_planted_slip = EXERCISE.audit_test(Path(__file__))
test_the_judge_rejects_a_second_slip = EXERCISE.audit_test(Path(__file__), second=True)
