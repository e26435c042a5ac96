"""Lesson 02: GPipe. Micro-batches fill the pipeline; activation checkpointing trades compute for memory.

    torchrun --nproc-per-node 2 lessons/02_gpipe_checkpoint.py --micro-batches 8 --checkpoint-segments 2

The idea. Lesson 01 sends the whole batch down the stages, so P - 1 of P ranks always wait. GPipe
cuts the batch of N rows into M micro-batches; stage s forwards micro-batch i while stage s+1
forwards i-1. Every rank runs all M forwards, then all M backwards, and steps its optimizer once.
With forward and backward taking t_f and t_b per micro-batch, the step takes (M + P - 1)(t_f + t_b)
of which each rank computes M(t_f + t_b), so the idle share, the bubble, is

    bubble = (P - 1) / (M + P - 1)        (1 - 1/P for M = 1, lesson 01; towards 0 as M grows).

The lesson computes it from the schedule itself (`distlab.pipeline.schedules`), not from the formula.

The exact loss. The step's loss is the mean over all N rows. Micro-batch i (n_i rows) has the mean
loss l_i, and L = sum_i (n_i / N) l_i, so each l_i is scaled by n_i / N before its backward; the
accumulated gradients are exactly the unsplit model's. A batch that M does not divide runs with
uneven micro-batches (torch.tensor_split: the first N mod M get one row more), still exact:
no error, and the scale n_i / N is what makes it exact. M must be between 1 and N.

The memory. Every stage holds the saved activations of all M micro-batches until its first
backward. `checkpoint_sequential(layers, K, use_reentrant=False)` keeps only the input of each of
its first K - 1 segments and reruns them in backward: less memory, more forward compute. For our
Linear + Tanh layers autograd saves one activation per layer (the Tanh output, which is also the
next layer's input), and PyTorch reruns only what backward needs, so a checkpointed segment of g
layers saves g - 1 activations and reruns g - 1 layers; a one-layer segment saves nothing. Both are
measured here: the bytes that pass through `torch.autograd.graph.saved_tensors_hooks`, and the
layer forward calls (a forward hook fires again on every recomputation).

What seed 004 got wrong. Its micro-batch loss `output.sum()` goes to backward unscaled, so the
gradient depends on M (with per-micro-batch means it is M times too large); it says the backward
must run in reverse micro-batch order (any order is right; PyTorch's GPipe runs first-in first-out,
as we do); it checkpoints with `checkpoint_sequential(model_part, 2, ...)` believing the whole stage
is checkpointed, yet the last segment never is (K = 1 would save nothing, and a one-layer stage with
K = 2 crashes); and each micro-batch is fresh random data with no target, so there is nothing to
check. Lesson 03 corrects its claim that 1F1B shrinks the bubble.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch.distributed as dist
import torch.nn.functional as F
from rich.table import Table

from distlab.cli import DTYPES, add_mlp_args, mlp_widths
from distlab.models import layered_mlp, regression_batch
from distlab.pipeline.partition import stage_bounds
from distlab.pipeline.report import check_runs
from distlab.pipeline.runner import microbatch_sizes, train_pipeline
from distlab.pipeline.schedules import gpipe, render, simulate
from distlab.reference import sgd_reference
from distlab.runtime import add_runtime_args, all_ranks_true, distributed, print0, run_main
from distlab.timeline import busy_fractions, max_concurrency
from distlab.timeline import render as render_spans


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--micro-batches", type=int, default=8, help="M, from 1 to the batch size")
    parser.add_argument("--checkpoint-segments", type=int, default=2,
                        help="K >= 2 checkpoint_sequential segments per stage for the checkpointed run")
    parser.add_argument("--report-json", help="write the measurements and spans here (rank 0)")
    return add_runtime_args(add_mlp_args(parser, layers=16, width=128, global_batch=256, steps=3)).parse_args()


def step_seconds(spans, steps: int) -> float:
    """Median over the steps after the first (which pays one-off costs) of first start to last end."""
    per_step = [max(s.end for s in spans if s.step == k) - min(s.start for s in spans if s.step == k)
                for k in range(min(1, steps - 1), steps)]
    return statistics.median(per_step)


def main() -> int:
    args = parse_args()
    dtype, m, k = DTYPES[args.dtype], args.micro_batches, args.checkpoint_segments
    if k < 2:
        raise ValueError(f"--checkpoint-segments must be >= 2 (this lesson compares 0 with K), got {k}")
    widths = mlp_widths(args)
    with distributed(args.device) as rt:
        p = rt.world_size
        print0(f"[bold]Lesson 02: GPipe with activation checkpointing[/] - {args.layers} layers on {p} "
               f"rank(s), batch {args.global_batch}, M={m}, backend {rt.backend}, {args.dtype}")
        # Both runs validate their input on every rank before any message (M, K, P <= layers).
        common = dict(schedule="gpipe", microbatches=m, seed=args.seed, dtype=dtype, probe=True)
        plain = train_pipeline(rt, widths, args.global_batch, args.steps, args.lr, **common)
        ckpt = train_pipeline(rt, widths, args.global_batch, args.steps, args.lr,
                              checkpoint_segments=k, **common)
        sizes = microbatch_sizes(args.global_batch, m)
        print0(f"micro-batch rows: {sizes}" + ("" if len(set(sizes)) == 1 else
               "  (uneven: each micro-batch loss is scaled by n_i / N, so the step is still exact)"))

        # The schedule as data: the grid, and the bubble counted from its idle cells.
        timing = simulate(gpipe(p, m))
        print0(render(timing, title=f"\nGPipe, P={p}, M={m}: one column per unit-time tick (F forward, B backward, . idle)"))
        bubble, formula = timing.bubble_fraction(), (p - 1) / (m + p - 1)
        print0(f"bubble counted from the grid: {bubble:.4f};  (P-1)/(M+P-1) = {formula:.4f}")
        curve = {mm: simulate(gpipe(p, mm)).bubble_fraction() for mm in sorted({1, p, 2 * p, 4 * p, 8 * p, m})}
        bubbles = Table(title="bubble vs M (grids)", title_justify="left")
        for mm in curve:
            bubbles.add_column(f"M={mm}", justify="right")
        bubbles.add_row(*(f"{b:.3f}" for b in curve.values()))
        print0(bubbles)

        # The independent reference: the unsplit model, the whole batch, one process.
        x, target = regression_batch(args.global_batch, widths[0], widths[-1], seed=args.seed, dtype=dtype)
        ref = sgd_reference(layered_mlp(widths, seed=args.seed, dtype=dtype), x, target,
                            F.mse_loss, args.steps, args.lr)
        table, matched = check_runs({"GPipe": plain, f"GPipe + checkpointing, K={k}": ckpt},
                                    ref, dtype)
        print0(table)

        # Memory and compute, measured on every stage.
        every: list[tuple] = [() for _ in range(p)]
        dist.all_gather_object(every, (plain.saved_peak_bytes, ckpt.saved_peak_bytes,
                                       plain.layer_forwards, ckpt.layer_forwards,
                                       plain.peak_in_flight, ckpt.peak_in_flight))
        memory = Table(title=f"what each stage holds for backward, and its forward work per step (K={k})",
                       title_justify="left", caption="saved bytes: peak of the tensors autograd saved "
                       "(saved_tensors_hooks), parameters excluded", caption_justify="left")
        for col in ("stage", "layers", "in flight", "saved, plain", "saved, ckpt", "ratio",
                    "layer fwd, plain", "layer fwd, ckpt", "extra fwd"):
            memory.add_column(col, justify="right")
        bounds = stage_bounds(args.layers, p)
        memory_ok = True
        for s, (sp, sc, fp, fc, ip, ic) in enumerate(every):
            # A checkpointed segment of g layers saves g - 1 fewer activations: only segments of
            # two or more layers can save anything (K is clamped to the stage's layer count).
            must_save = len(bounds[s]) // min(k, len(bounds[s])) >= 2
            memory_ok &= sc < sp if must_save else sc <= sp
            memory_ok &= ip == ic == m  # GPipe holds every micro-batch before its first backward
            memory.add_row(str(s), str(len(bounds[s])), str(ip), f"{sp / 2**10:,.1f} KiB",
                           f"{sc / 2**10:,.1f} KiB", f"{sc / sp:.2f}", str(fp), str(fc), f"{fc / fp - 1:+.0%}")
        print0(memory)
        if not any(len(b) // min(k, len(b)) >= 2 for b in bounds):
            print0(f"[yellow]note:[/] with K={k} every checkpointed segment is a single layer, and for this "
                   "model a single layer saves nothing (its input and output are kept anyway); "
                   "use K <= layers per stage / 2")

        last = [s for s in plain.spans if s.step == args.steps - 1]
        print0("\n[bold]Who computes when in the last step[/] (measured, without checkpointing):")
        print0(render_spans(last, p))
        print0(f"most ranks computing at one instant: {max_concurrency(last)}; busy fraction per rank: "
               + ", ".join(f"{f:.0%}" for f in busy_fractions(last, p)))
        t_plain, t_ckpt = step_seconds(plain.spans, args.steps), step_seconds(ckpt.spans, args.steps)
        print0(f"step time (median, compute spans): {t_plain * 1e3:.1f} ms plain, {t_ckpt * 1e3:.1f} ms "
               f"checkpointed ({t_ckpt / t_plain - 1:+.0%}; a shared CPU makes this noisy)")

        if args.report_json and rt.is_first:
            with open(args.report_json, "w") as f:
                json.dump({"P": p, "M": m, "K": k, "bubble_curve": curve, "bubble": bubble,
                           "stages": [dict(zip(("saved_plain", "saved_ckpt", "forwards_plain",
                                                "forwards_ckpt", "in_flight", "in_flight_ckpt"), e))
                                      for e in every],
                           "spans": [vars(s) for s in last]}, f)

        bubble_ok = abs(bubble - formula) < 1e-12
        ok = all_ranks_true(matched and bubble_ok and memory_ok)
        print0(f"\n[bold]{'PASS' if ok else 'FAIL'}[/]: GPipe {'equals' if matched else 'DOES NOT equal'} "
               f"the unsplit model with and without checkpointing; bubble {bubble:.3f} = (P-1)/(M+P-1); "
               f"checkpointing {'cuts' if memory_ok else 'DOES NOT cut'} the saved activations")
    return 0 if ok else 1


if __name__ == "__main__":
    run_main(main)
