"""Lesson 04: the real engine. torch.distributed.pipelining runs the same split model, and agrees.

    torchrun --nproc-per-node 4 lessons/04_torch_pipelining.py --micro-batches 4

The idea. Lessons 02 and 03 built GPipe and 1F1B by hand: schedules as data, a runner, batched
send/recv. At scale you use PyTorch's: wrap each rank's stage in `PipelineStage(module, s, P,
device)`, give it to `ScheduleGPipe(stage, M, loss_fn)` or `Schedule1F1B(...)`, and call
`schedule.step(x)` on rank 0, `schedule.step(target=y, losses=...)` on the last rank and
`schedule.step()` in between. This lesson runs exactly our model, split exactly as ours, both ways,
and checks that PyTorch's gradients and parameters equal ours and the unsplit model's, and that the
per-rank order of forwards and backwards it executes is the order our schedules prescribe.

Where PyTorch differs (torch 2.13; `src/distlab/pipeline/torch_engine.py` has the details):
- Loss reduction. It runs backward on each micro-batch's loss as returned (a mean over that
  micro-batch) and, with `scale_grads=True` (the default), divides the gradients by M at the end:
  the mean of the micro-batch means. That is the batch mean only for equal micro-batches; ours
  scales each loss by n_i / N instead. With `scale_grads=False` (meant for a sum loss) a mean loss
  gets M times the gradient: the lesson shows the factor.
- Equal micro-batches only: it infers the receive shapes from micro-batch 0. So this lesson
  requires M to divide the batch (ValueError up front, on every rank); ours runs uneven ones exactly.
- `Schedule1F1B` refuses M < P; ours runs it (the first stages then behave like GPipe). The lesson
  prints PyTorch's refusal and goes on with GPipe.
- Its printed plan, `schedule.pipeline_order`, is not what it runs: for 1F1B the last rank's plan
  reads F1 .. F_M. The lesson shows the plan beside the executed order.
"""

from __future__ import annotations

import argparse
import json

import torch.distributed as dist
import torch.nn.functional as F
from rich.table import Table

from distlab.cli import DTYPES, add_mlp_args, mlp_widths
from distlab.compare import all_ok, compare
from distlab.models import layered_mlp, regression_batch
from distlab.pipeline.report import check_runs
from distlab.pipeline.runner import train_pipeline
from distlab.pipeline.schedules import gpipe, one_f_one_b
from distlab.pipeline.torch_engine import TORCH_SCHEDULES, train_torch_pipeline
from distlab.reference import sgd_reference
from distlab.runtime import add_runtime_args, all_ranks_true, distributed, print0, run_main

TITLES = {"gpipe": "GPipe", "1f1b": "1F1B"}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--micro-batches", type=int, default=4, help="M; must divide the batch size")
    parser.add_argument("--report-json", help="write the per-rank orders here (rank 0)")
    return add_runtime_args(add_mlp_args(parser, layers=16, width=128, global_batch=256, steps=3)).parse_args()


def orders(text_of: dict[str, list], p: int, title: str) -> Table:
    """Per rank, one column per named order; a cell that differs from the first column is yellow."""
    table = Table(title=title, title_justify="left")
    table.add_column("rank", justify="right")
    for name in text_of:
        table.add_column(name)
    for r in range(p):
        first = list(text_of.values())[0][r]
        cells = [" ".join(map(str, order[r])) if i == 0 or order[r] == first
                 else "[yellow]" + " ".join(map(str, order[r])) + "[/]"
                 for i, order in enumerate(text_of.values())]
        table.add_row(str(r), *cells)
    return table


def main() -> int:
    args = parse_args()
    dtype, m = DTYPES[args.dtype], args.micro_batches
    widths = mlp_widths(args)
    with distributed(args.device) as rt:
        p = rt.world_size
        print0(f"[bold]Lesson 04: torch.distributed.pipelining[/] - {args.layers} layers on {p} rank(s), "
               f"batch {args.global_batch}, M={m}, backend {rt.backend}, {args.dtype}")
        kwargs = dict(microbatches=m, seed=args.seed, dtype=dtype)
        ours, theirs, refused = {}, {}, {}
        for name in TORCH_SCHEDULES:
            try:  # PyTorch's own validation (1F1B: M >= P) raises on every rank before any message
                theirs[name] = train_torch_pipeline(rt, widths, args.global_batch, args.steps, args.lr,
                                                    schedule=name, **kwargs)
            except ValueError as err:
                if name != "1f1b" or m >= p:
                    raise  # bad input (M does not divide the batch, too many ranks): not a lesson point
                refused[name] = str(err)
            ours[name] = train_pipeline(rt, widths, args.global_batch, args.steps, args.lr, schedule=name,
                                        gather_spans=False, **kwargs)
        for name, message in refused.items():
            print0(f"[yellow]PyTorch's Schedule1F1B refuses M={m} < P={p}:[/] {message} "
                   f"(ours runs it: lesson 03)")

        x, target = regression_batch(args.global_batch, widths[0], widths[-1], seed=args.seed, dtype=dtype)
        ref = sgd_reference(layered_mlp(widths, seed=args.seed, dtype=dtype), x, target,
                            F.mse_loss, args.steps, args.lr)
        runs = {f"ours, {TITLES[n]}": ours[n] for n in ours}
        runs.update({f"PyTorch, {TORCH_SCHEDULES[n]}": theirs[n] for n in theirs})
        table, matched = check_runs(runs, ref, dtype)
        print0(table)
        versus = {f"PyTorch {TORCH_SCHEDULES[n]} vs ours": n for n in theirs}
        table, agree = check_runs({label: theirs[n] for label, n in versus.items()},
                                  {label: ours[n] for label, n in versus.items()}, dtype,
                                  title="PyTorch against our runner, schedule by schedule")
        print0(table)

        # Orders: what our schedules prescribe, what PyTorch executed, what its plan says.
        per_rank: list[dict] = [{} for _ in range(p)]
        dist.all_gather_object(per_rank, {n: (r.executed, r.planned) for n, r in theirs.items()})
        schedules = {"gpipe": gpipe(p, m), "1f1b": one_f_one_b(p, m)}
        order_ok = True
        report = {}
        for name in theirs:
            executed = [per_rank[r][name][0] for r in range(p)]
            planned = [per_rank[r][name][1] for r in range(p)]
            order_ok &= executed == schedules[name]
            print0(orders({f"ours ({TITLES[name]})": schedules[name], "PyTorch executed": executed,
                           "PyTorch pipeline_order": planned}, p,
                          f"{TITLES[name]}: per-rank order of forwards and backwards"))
            wrong = [r for r in range(p) if planned[r] != executed[r]]
            if wrong:
                print0(f"[yellow]PyTorch's printed plan differs from what it runs on rank(s) {wrong}[/]")
            report[name] = {k: [[str(a) for a in o] for o in v] for k, v in
                            (("ours", schedules[name]), ("executed", executed), ("planned", planned))}

        # scale_grads=False with a mean loss: every gradient M times too large.
        unscaled = train_torch_pipeline(rt, widths, args.global_batch, 1, args.lr, schedule="gpipe",
                                        scale_grads=False, **kwargs)
        mine = unscaled.first_grads.keys()
        times_m = all_ok(compare({n: m * ref.first_grads[n] for n in mine}, unscaled.first_grads))
        as_is = all_ok(compare({n: ref.first_grads[n] for n in mine}, unscaled.first_grads))
        factor_ok = all_ranks_true(times_m and (m == 1 or not as_is))
        print0(f"\nScheduleGPipe with scale_grads=False and a mean loss: gradients "
               f"{'equal M = ' + str(m) + ' times' if factor_ok else 'DO NOT equal M times'} the "
               f"unsplit model's. scale_grads=True divides by M: right for equal micro-batches only.")

        if args.report_json and rt.is_first:
            with open(args.report_json, "w") as f:
                json.dump({"P": p, "M": m, "orders": report, "refused": refused}, f)

        ok = all_ranks_true(matched and agree and order_ok and factor_ok)
        print0(f"\n[bold]{'PASS' if ok else 'FAIL'}[/]: PyTorch's "
               f"{' and '.join(TORCH_SCHEDULES[n] for n in theirs)} "
               f"{'equal' if matched and agree else 'DO NOT equal'} ours and the unsplit model; the order it "
               f"executes {'is' if order_ok else 'IS NOT'} ours on every rank")
    return 0 if ok else 1


if __name__ == "__main__":
    run_main(main)
