"""Lesson 01: naive model parallelism. The layers are split across ranks; send/recv carry the
activations forward and their gradients back.

    torchrun --nproc-per-node 2 lessons/01_model_parallel.py     # any P from 1 to the layer count

The idea. A model too big for one device is cut into P contiguous stages, one per rank. Rank s
computes A_s = f_s(A_{s-1}) and sends A_s to rank s+1. The last rank computes the loss L. Backward
runs the chain rule across each cut: rank s+1 computes dL/dA_s (the gradient of its *input*) and
sends it back; rank s resumes with `A_s.backward(dL/dA_s)`, which gives

    dL/dW_s = dL/dA_s * dA_s/dW_s     and     dL/dA_{s-1} = dL/dA_s * dA_s/dA_{s-1}, sent on to s-1.

Every parameter lives on one rank, so each rank steps its own optimizer and no gradient is averaged.

The self-check. Every rank also trains an unsplit deep copy of the model on the whole batch in one
process, and compares its own stage's gradients (after step 1) and parameters (after the last step)
with the copy's. The spans each rank records show that only one rank computes at any instant: the
others wait in `recv`. Lesson 02 fills that idle time with micro-batches.

What seed 004 got wrong: `layers_per_rank = ceil(L/P); start = rank * layers_per_rank` leaves the
last ranks empty when P does not divide L nicely (L=6, P=4 gives 2, 2, 2, 0); here the first L mod P
stages get the extra layer. Its loss `output.sum()` also hides the batch scaling; ours is the mean
squared error over the whole batch, the same number the unsplit model computes.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist
import torch.nn.functional as F

from distlab.cli import DTYPES, add_mlp_args, mlp_widths
from distlab.compare import all_ok, compare, comparison_table, tolerances
from distlab.models import layered_mlp, regression_batch
from distlab.pipeline.naive import train_model_parallel
from distlab.reference import sgd_reference
from distlab.runtime import add_runtime_args, all_ranks_true, distributed, print0, run_main
from distlab.timeline import busy_fractions, max_concurrency, render


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input-features", type=int, default=16,
                        help="features per sample; anything but 16 shows the 'does not fit' error")
    parser.add_argument("--timeline-json", help="write every rank's compute spans here (rank 0)")
    return add_runtime_args(add_mlp_args(parser, layers=8, width=256, global_batch=512, steps=5)).parse_args()


def main() -> int:
    args = parse_args()
    dtype = DTYPES[args.dtype]
    widths = mlp_widths(args)
    with distributed(args.device) as rt:
        print0(f"[bold]Lesson 01: naive model parallelism[/] - {args.layers} layers on "
               f"{rt.world_size} rank(s), backend {rt.backend}, {args.steps} SGD steps, {args.dtype}")
        run = train_model_parallel(rt, widths, args.global_batch, args.steps, args.lr, seed=args.seed,
                                   dtype=dtype, input_features=args.input_features)

        # The independent reference: the unsplit model, the whole batch, one process.
        x, target = regression_batch(args.global_batch, widths[0], widths[-1], seed=args.seed, dtype=dtype)
        ref = sgd_reference(layered_mlp(widths, seed=args.seed, dtype=dtype), x, target,
                            F.mse_loss, args.steps, args.lr)
        mine = run.first_grads.keys()
        rows = {
            "gradients after step 1": compare({n: ref.first_grads[n] for n in mine}, run.first_grads),
            f"parameters after {args.steps} steps": compare({n: ref.params[n] for n in mine}, run.params),
        }
        every_rows: list[dict] = [{} for _ in range(rt.world_size)]
        dist.all_gather_object(every_rows, rows)

        rtol, atol = tolerances(dtype)
        for title in rows:
            table_rows = [row for per_rank in every_rows for row in per_rank[title]]
            print0(comparison_table(table_rows, f"{title}: split vs unsplit",
                                    caption=f"allclose with rtol {rtol:g}, atol {atol:g}"))
        losses_ok = torch.allclose(torch.tensor(run.losses), torch.tensor(ref.losses), rtol=rtol, atol=atol)
        print0("loss per step, split:   " + " ".join(f"{v:.6f}" for v in run.losses))
        print0("loss per step, unsplit: " + " ".join(f"{v:.6f}" for v in ref.losses))

        peak = max_concurrency(run.spans)
        # Step 0 pays one-off costs (first connections, allocations); draw the last, steady step.
        last_step = [s for s in run.spans if s.step == args.steps - 1]
        print0(f"\n[bold]Who computes when in step {args.steps}[/] (F forward, B backward, . waiting in recv):")
        print0(render(last_step, rt.world_size))
        print0("busy fraction per rank: " + ", ".join(
            f"rank {r} {f:.0%}" for r, f in enumerate(busy_fractions(last_step, rt.world_size))))
        print0(f"most ranks computing at one instant: {peak} (naive model parallelism: exactly 1)")
        if args.timeline_json and rt.is_first:
            with open(args.timeline_json, "w") as f:
                json.dump([vars(s) for s in run.spans], f)

        matched = all(all_ok(r) for per_rank in every_rows for r in per_rank.values()) and losses_ok
        ok = all_ranks_true(matched and peak == 1)
        print0(f"\n[bold]{'PASS' if ok else 'FAIL'}[/]: split gradients and parameters "
               f"{'equal' if matched else 'DO NOT equal'} the unsplit model's; "
               f"{'one rank' if peak == 1 else f'{peak} ranks'} computing at a time")
    return 0 if ok else 1


if __name__ == "__main__":
    run_main(main)
