"""Lesson 03: 1F1B. The same bubble as GPipe, a fraction of its activation memory.

    torchrun --nproc-per-node 4 lessons/03_one_f_one_b.py --micro-batches 7

The idea. GPipe runs every forward before any backward, so each stage holds the saved activations of
all M micro-batches at once. 1F1B (PipeDream-flush) lets stage s start a backward as soon as one
can run: after a warm-up of min(P - s - 1, M) forwards it alternates one forward and one backward,
then drains the remaining backwards. A micro-batch's activations are freed by its backward, so

    in flight on stage s:  GPipe M,   1F1B min(M, P - s)        (at most P, whatever M is)

and the memory no longer grows with M. The bubble does not change: the first forward still needs
P - 1 ticks to reach the last stage and the last backward P - 1 ticks to come back, so both take
(M + P - 1)(t_f + t_b) and idle (P - 1)/(M + P - 1) of it. What 1F1B buys is the freedom to raise M
(which is what shrinks the bubble) without running out of memory.

Deadlock. In the steady state stage s sends an activation forward while stage s+1 sends a gradient
back. With blocking send/recv each waits in its send for the other's receive, forever (gloo's send
is a rendezvous even for one number). The runner posts the sends of one action together with the
receives of the next in one `batch_isend_irecv` (src/distlab/pipeline/p2p.py); the tests replay every
rank's plan for P <= 6, M <= 13 and show that blocking transfers in 1F1B's order would deadlock.

M < P is allowed here: the first stages then never reach a steady state and behave like GPipe
(PyTorch's Schedule1F1B refuses M < P; lesson 04). Uneven micro-batches are exact, as in lesson 02.

What seed 004 got wrong. Its section 4.2 says 1F1B "significantly reduces the idle time (the
bubble)"; it does not, it reduces the memory. Its section 6 rightly says 1F1B needs non-blocking
sends and receives, but its code only ever runs the GPipe order with blocking ones.
"""

from __future__ import annotations

import argparse
import json

import torch.distributed as dist
import torch.nn.functional as F
from rich.table import Table

from distlab.cli import DTYPES, add_mlp_args, mlp_widths
from distlab.models import layered_mlp, regression_batch
from distlab.pipeline.report import check_runs
from distlab.pipeline.runner import microbatch_sizes, train_pipeline
from distlab.pipeline.schedules import gpipe, one_f_one_b, peak_in_flight, render, simulate
from distlab.reference import sgd_reference
from distlab.runtime import add_runtime_args, all_ranks_true, distributed, print0, run_main
from distlab.timeline import render as render_spans


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--micro-batches", type=int, default=8, help="M, from 1 to the batch size")
    parser.add_argument("--report-json", help="write the measurements and spans here (rank 0)")
    return add_runtime_args(add_mlp_args(parser, layers=16, width=128, global_batch=256, steps=3)).parse_args()


def main() -> int:
    args = parse_args()
    dtype, m = DTYPES[args.dtype], args.micro_batches
    widths = mlp_widths(args)
    with distributed(args.device) as rt:
        p = rt.world_size
        print0(f"[bold]Lesson 03: 1F1B[/] - {args.layers} layers on {p} rank(s), batch {args.global_batch} "
               f"in M={m} micro-batches of {microbatch_sizes(args.global_batch, m)} rows, backend "
               f"{rt.backend}, {args.dtype}")
        common = dict(microbatches=m, seed=args.seed, dtype=dtype, probe=True)
        runs = {name: train_pipeline(rt, widths, args.global_batch, args.steps, args.lr, schedule=name, **common)
                for name in ("gpipe", "1f1b")}

        # The schedules as data: grids, bubbles, and the in-flight count read off each rank's order.
        schedules = {"gpipe": gpipe(p, m), "1f1b": one_f_one_b(p, m)}
        timings = {name: simulate(sched) for name, sched in schedules.items()}
        for name, title in (("1f1b", "1F1B"), ("gpipe", "GPipe")):
            print0(render(timings[name], title=f"\n{title}, P={p}, M={m} (unit-time ticks; . idle)"))
        bubbles = {name: t.bubble_fraction() for name, t in timings.items()}
        formula = (p - 1) / (m + p - 1)
        print0(f"bubble from the grids: GPipe {bubbles['gpipe']:.4f}, 1F1B {bubbles['1f1b']:.4f}; "
               f"(P-1)/(M+P-1) = {formula:.4f}: the same bubble")

        x, target = regression_batch(args.global_batch, widths[0], widths[-1], seed=args.seed, dtype=dtype)
        ref = sgd_reference(layered_mlp(widths, seed=args.seed, dtype=dtype), x, target,
                            F.mse_loss, args.steps, args.lr)
        table, matched = check_runs({"GPipe": runs["gpipe"], "1F1B": runs["1f1b"]}, ref, dtype)
        print0(table)

        every: list[tuple] = [() for _ in range(p)]
        dist.all_gather_object(every, tuple(v for r in runs.values()
                                            for v in (r.peak_in_flight, r.saved_peak_bytes)))
        expected = {name: peak_in_flight(sched) for name, sched in schedules.items()}
        memory = Table(title="micro-batches in flight and activation bytes held, per stage (measured while running)",
                       title_justify="left", caption="saved bytes: peak of the tensors autograd saved "
                       "(saved_tensors_hooks), parameters excluded", caption_justify="left")
        for col in ("stage", "GPipe in flight", "1F1B in flight", "min(M, P-s)", "GPipe saved",
                    "1F1B saved", "1F1B / GPipe"):
            memory.add_column(col, justify="right")
        memory_ok = True
        for s, (in_g, saved_g, in_1, saved_1) in enumerate(every):
            memory_ok &= in_g == expected["gpipe"][s] == m and in_1 == expected["1f1b"][s] == min(m, p - s)
            memory_ok &= saved_1 <= saved_g
            memory.add_row(str(s), str(in_g), str(in_1), str(min(m, p - s)), f"{saved_g / 2**10:,.1f} KiB",
                           f"{saved_1 / 2**10:,.1f} KiB", f"{saved_1 / saved_g:.2f}")
        print0(memory)

        last = [s for s in runs["1f1b"].spans if s.step == args.steps - 1]
        print0("\n[bold]Who computes when in 1F1B's last step[/] (measured; the grid above is the ideal):")
        print0(render_spans(last, p))

        if args.report_json and rt.is_first:
            with open(args.report_json, "w") as f:
                json.dump({"P": p, "M": m, "bubbles": bubbles,
                           "in_flight": {"gpipe": [e[0] for e in every], "1f1b": [e[2] for e in every]},
                           "saved": {"gpipe": [e[1] for e in every], "1f1b": [e[3] for e in every]},
                           "spans": {name: [vars(s) for s in r.spans if s.step == args.steps - 1]
                                     for name, r in runs.items()}}, f)

        bubble_ok = abs(bubbles["gpipe"] - formula) < 1e-12 and abs(bubbles["1f1b"] - formula) < 1e-12
        ok = all_ranks_true(matched and bubble_ok and memory_ok)
        print0(f"\n[bold]{'PASS' if ok else 'FAIL'}[/]: 1F1B and GPipe {'equal' if matched else 'DO NOT equal'} "
               f"the unsplit model; both idle (P-1)/(M+P-1) = {formula:.3f}; 1F1B "
               f"{'holds' if memory_ok else 'DOES NOT hold'} min(M, P-s) micro-batches on stage s, GPipe all {m}")
    return 0 if ok else 1


if __name__ == "__main__":
    run_main(main)
