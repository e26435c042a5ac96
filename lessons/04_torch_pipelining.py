"""Lesson 04: the real engine. torch.distributed.pipelining runs the same split model, and agrees.

    torchrun --nproc-per-node 4 lessons/04_torch_pipelining.py --micro-batches 4

The idea. Lessons 02 and 03 built GPipe and 1F1B by hand: schedules as data, a runner, batched
send/recv. At scale you use PyTorch's: wrap each rank's stage in `PipelineStage(module, p, P,
device)`, give it to `ScheduleGPipe(stage, M, loss_fn)` or `Schedule1F1B(...)`, and call
`schedule.step(x)` on rank 0, `schedule.step(target=y, losses=...)` on the last rank and
`schedule.step()` in between. This lesson runs exactly our model, split exactly as ours, both ways,
and checks that PyTorch's gradients and parameters equal ours and the unsplit model's, and that the
per-rank order of forwards and backwards it executes is the order our schedules prescribe.

The mechanism: `pipeline_for_rank` below builds this rank's PipelineStage and schedule;
`distlab/model_split/torch_engine.py: TorchStep` makes the step calls above (and records what each stage
executes), trained by the track's one loop, `distlab/model_split/training.py: train`.

Where PyTorch differs (torch 2.13):
- Loss reduction. It runs backward on each micro-batch's loss as returned (a mean over that
  micro-batch) and, with `scale_grads=True` (the default), divides the gradients by M at the end:
  the mean of the micro-batch means. That is the batch mean only for equal micro-batches; ours
  scales each loss by n_i / N instead. With `scale_grads=False` (meant for a sum loss) a mean loss
  gets M times the gradient: the lesson shows the factor.
- Equal micro-batches only: it infers the receive shapes from micro-batch 0. So this lesson
  requires M to divide N (a one-line error up front, on every rank); ours runs uneven ones exactly.
- `Schedule1F1B` refuses M < P; ours runs it (the first ranks then behave like GPipe). The lesson
  prints PyTorch's refusal and goes on with GPipe.
- Its printed plan, `schedule.pipeline_order`, is not what it runs: for 1F1B the last rank's plan
  reads F1 .. F_M. The lesson shows the plan beside the executed order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from distlab.model_split.report import check_runs, gathered, orders_table
from distlab.model_split.runner import PipelineStep
from distlab.model_split.schedules import make_schedule
from distlab.model_split.torch_engine import TORCH_SCHEDULES, TorchStep
from distlab.model_split.training import PipelineConfig, train, unsplit_reference
from distlab.processes.console import print0
from distlab.processes.flags import check_flags_against_world, positive_int
from distlab.processes.runtime import distributed, run_main
from distlab.proof.cli import add_mlp_args, lesson_parser, mlp_run, stages_fit_layers
from distlab.proof.compare import all_ok, compare
from distlab.proof.verdict import Verdict

# ---- the mechanism: our split model, run by torch.distributed.pipelining -------------------------

TITLES = {"gpipe": "GPipe", "1f1b": "1F1B"}


def pipeline_for_rank(
    module: torch.nn.Module, p: int, num_ranks: int, device: torch.device, name: str, microbatches: int
):
    """Stage p of P as torch's PipelineStage, and the schedule `name` ("gpipe": ScheduleGPipe, "1f1b":
    Schedule1F1B) that runs it over M micro-batches with the mean squared error as each one's loss."""
    from torch.distributed import pipelining  # a second of imports, only when used

    if name not in TITLES:
        raise ValueError(f"this lesson runs {list(TITLES)}, got {name!r}")
    stage = pipelining.PipelineStage(module, p, num_ranks, device)
    schedule_class = {"gpipe": pipelining.ScheduleGPipe, "1f1b": pipelining.Schedule1F1B}[name]
    return stage, schedule_class(stage, microbatches, loss_fn=F.mse_loss)


# ---- the chapter, part by part -------------------------------------------------------------------


def parse_args(argv: list[str] | None = None):
    parser = add_mlp_args(lesson_parser(__doc__), layers=16, width=128, global_batch=256, steps=3)
    parser.add_argument("--micro-batches", type=positive_int, default=4, help="M; must divide N")
    return parser.parse_args(argv)


def both_engines(rt, cfg: PipelineConfig) -> tuple[dict, dict, dict]:
    """Ours and PyTorch's run of each schedule; PyTorch's refusals (raised by its constructor on
    every rank alike, before any message) by schedule name."""
    ours, theirs, refused = {}, {}, {}
    for name in TITLES:
        named = cfg.replace(schedule=name)
        try:
            theirs[name] = train(rt, named, TorchStep(rt, named, pipeline_for_rank))
        except ValueError as err:
            if name != "1f1b" or cfg.micro_batches >= rt.world_size:
                raise  # bad input (M does not divide N, too many ranks): not a lesson point
            refused[name] = str(err)
        ours[name] = train(rt, named, PipelineStep(rt, named))
    return ours, theirs, refused


def show_orders(theirs: dict, world: int, m: int, verdict: Verdict) -> None:
    """Each rank's order: what our schedule prescribes, what PyTorch ran, what it printed as its plan."""
    for name, run in theirs.items():  # what our schedule prescribes, what PyTorch ran, what it printed
        executed, planned = zip(*gathered((run.executed, run.planned)))
        mine = make_schedule(name, world, m)
        print0(
            orders_table(
                {f"ours ({TITLES[name]})": mine, "PyTorch executed": executed, "PyTorch pipeline_order": planned},
                f"{TITLES[name]}: each rank's order",
            )
        )
        differ = [r for r in range(world) if planned[r] != executed[r]]
        if differ:
            print0(f"[yellow]PyTorch's printed plan differs from what it runs on rank(s) {differ}[/]")
        verdict.check(
            f"PyTorch's {TORCH_SCHEDULES[name]} executes our {TITLES[name]} order on every rank",
            list(executed) == mine,
        )
        verdict.figure(
            f"orders_{name}",
            {
                k: [[str(a) for a in o] for o in v]
                for k, v in (("ours", mine), ("executed", executed), ("planned", planned))
            },
        )


def main() -> int:
    args = check_flags_against_world(parse_args(), stages_fit_layers)
    cfg = PipelineConfig(**mlp_run(args), gather_spans=False)
    m = cfg.micro_batches
    with distributed(args.device) as rt:
        world, verdict = rt.world_size, Verdict(rt)
        print0(
            f"[bold]Lesson 04: torch.distributed.pipelining[/] - {args.layers} layers on {world} rank(s), "
            f"N={args.global_batch} in M={m} micro-batches, {args.dtype}, {rt.backend}"
        )
        ours, theirs, refused = both_engines(rt, cfg)
        for message in refused.values():
            print0(f"[yellow]PyTorch's Schedule1F1B refuses M={m} < P={world}:[/] {message} (ours runs it: lesson 03)")
        ref = unsplit_reference(cfg)
        runs = {f"ours, {TITLES[n]}": r for n, r in ours.items()} | {TORCH_SCHEDULES[n]: r for n, r in theirs.items()}
        table, matched = check_runs(runs, ref, cfg.dtype)
        print0(table)
        verdict.check("ours and PyTorch's gradients, parameters and losses equal the unsplit model's", matched)
        table, agree = check_runs(
            {f"{TORCH_SCHEDULES[n]} vs ours": theirs[n] for n in theirs},
            {f"{TORCH_SCHEDULES[n]} vs ours": ours[n] for n in theirs},
            cfg.dtype,
            title="PyTorch against our runner, schedule by schedule",
        )
        print0(table)
        verdict.check("PyTorch's equal ours, schedule by schedule", agree)

        show_orders(theirs, world, m, verdict)

        # scale_grads=False with a mean loss: every gradient M times too large.
        one = cfg.replace(steps=1, scale_grads=False)
        unscaled = train(rt, one, TorchStep(rt, one))
        want = {n: m * g for n, g in ref.first_grads.items() if n in unscaled.first_grads}
        verdict.check(
            f"ScheduleGPipe with scale_grads=False and a mean loss gives M = {m} times the gradient "
            "(scale_grads=True divides by M: right for equal micro-batches only)",
            all_ok(compare(want, unscaled.first_grads)),
        )
        verdict.figure("refused", refused)
        return verdict.finish(args.json)


if __name__ == "__main__":
    run_main(main)
