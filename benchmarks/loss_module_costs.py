"""What a practitioner pays: the loss module in a validation loop, and the whole step with its finite-gradient
guard, against open_clip's recipe.

    torchrun --standalone --nproc-per-node 2 benchmarks/loss_module_costs.py

Three rows, each method's wall clock (the slowest rank, median of --repeats, the methods interleaved so that load
on a shared machine hits them alike; `measure.measure_interleaved`) and its ratio to the row's first method: the
median over the repetitions of the two methods' times within one repetition (the same load on both); and the CPU
seconds each call spent in its process (`time.process_time`, the worst rank's median and paired ratio): on a
machine shared with other jobs the wall clock is mostly the wait for a core, the CPU seconds what a method costs:

  validation  N = --val-n (4,096) pairs of d = 256 float32 embeddings: `ClipLoss` under torch.no_grad() (the
              gather and phase 2: no phase 3), against the loss alone (open_clip's recipe under no_grad: the
              gather and the C x N logits' cross-entropy), and against the module with gradients on (forward
              and backward: what it cost under no_grad before it knew to skip phase 3).
  step        N = --step-n (1,024): `distributed_train_step` at B = C (zero_grad, the streamed backward, the
              fused `agree_gradients_finite`, AdamW's step; the torch tiles make each rank's own block of S once,
              `own_block`), against open_clip's recipe (its ClipLoss with
              local_loss=True, gather_with_grad=True, backward, AdamW's step) on `clip_step.py`'s two-tower
              encoder under DDP; the guard alone (check and exchange), its fused check alone (GradScaler's), the
              infinity norm `torch._foreach_norm` it made before, and a per-tensor torch.isfinite.
  check       the finite check alone on --check-tensors (8) gradients of 2^20 float32: the same three.
Writes benchmarks/results/loss_module_costs_p{P}.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from distlab.processes.console import print0
from distlab.processes.flags import positive_int
from distlab.processes.runtime import distributed, run_main
from distlab.proof.cli import add_runtime_args
from distlab.streamed.safeguards.finite import agree_gradients_finite, finite_flags
from distributed_clip import ClipLoss, distributed_train_step

sys.path.insert(0, str(Path(__file__).parent))
from clip_step import device_name, local_batch, make_model, train_step  # noqa: E402
from clip_step_losses import OPEN_CLIP, TAU, config, open_clip_loss  # noqa: E402
from measure import local_embeddings, measure_interleaved, worst_rank  # noqa: E402

RESULTS = Path(__file__).parent / "results"


def validation_calls(args, rt) -> dict:
    z_x, z_y = local_embeddings(args.val_n, args.dim, rt)
    module = ClipLoss(rank=rt.rank, world_size=rt.world_size, stream_chunk_size=args.stream_chunk)
    s = torch.tensor(1 / TAU, device=rt.device)

    def module_no_grad():
        with torch.no_grad():
            return module(z_x, z_y, s)

    def loss_alone():
        with torch.no_grad():
            return open_clip_loss(z_x, z_y, rt)

    def module_with_grad():
        x, y = z_x.clone().requires_grad_(), z_y.clone().requires_grad_()
        module(x, y, s).backward()

    return {
        "ClipLoss under no_grad": module_no_grad,
        "the loss alone": loss_alone,
        "ClipLoss + backward": module_with_grad,
    }


def step_calls(args, rt) -> dict:
    x, y = local_batch(args.step_n, rt)
    calls = {}
    model = make_model(args, rt)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    calls[OPEN_CLIP] = lambda: train_step(OPEN_CLIP, model, opt, x, y, rt, args.stream_chunk)
    streamed = make_model(args, rt)
    opt2 = torch.optim.AdamW(streamed.parameters(), lr=1e-4)
    cfg = config(args.step_n, args.step_n // rt.world_size, args.stream_chunk)
    calls["distributed_train_step, B = C (guard in)"] = lambda: distributed_train_step(streamed, opt2, x, y, cfg)
    calls["the guard: check and exchange"] = lambda: agree_gradients_finite(streamed)
    calls["its check alone, fused (finite_flags)"] = lambda: finite_flags(grads_of(streamed))
    calls["the infinity norm it took before"] = lambda: inf_norm_check(grads_of(streamed))
    calls["a full-size isfinite each"] = lambda: isfinite_each(grads_of(streamed))
    return calls


def check_calls(args, rt) -> dict:
    """The finite check alone on a larger model's gradients: --check-tensors tensors of 2^20 float32 each."""
    gen = torch.Generator().manual_seed(rt.rank)
    grads = [torch.randn(2**20, generator=gen).to(rt.device) for _ in range(args.check_tensors)]
    return {
        "fused (finite_flags)": lambda: finite_flags(grads),
        "infinity norm (_foreach_norm)": lambda: inf_norm_check(grads),
        "isfinite each": lambda: isfinite_each(grads),
    }


ROWS = {"validation": validation_calls, "step": step_calls, "check": check_calls}


def grads_of(model) -> list[torch.Tensor]:
    """The gradients the last step left (every step sets them anew: read them at the call)."""
    return [p.grad for p in model.parameters() if p.grad is not None]


def isfinite_each(grads: list[torch.Tensor]) -> list[bool]:
    """The plain check: a full-size boolean tensor per gradient."""
    return torch.stack([torch.isfinite(g).all() for g in grads]).tolist()


def inf_norm_check(grads: list[torch.Tensor]) -> list[bool]:
    """The check the guard made before GradScaler's: every gradient's max |g| by `torch._foreach_norm(..., inf)`."""
    return torch.isfinite(torch.stack(torch._foreach_norm(grads, float("inf")))).tolist()


def run_row(name: str, calls: dict, args, rt) -> dict:
    for fn in calls.values():
        fn()  # warm-up: DDP's first iteration, AdamW's state, lazy allocations
    cpu = {method: [] for method in calls}
    got = measure_interleaved({m: cpu_timed(fn, cpu[m]) for m, fn in calls.items()}, rt, args.repeats)
    base, base_cpu = got[next(iter(got))]["times_s"], cpu[next(iter(got))][-args.repeats :]
    for method, row in got.items():
        # Each repetition ran every method in turn: the ratio within one repetition saw the same load.
        row["paired_ratio"] = statistics.median(t / t0 for t, t0 in zip(row["times_s"], base))
        mine = cpu[method][-args.repeats :]  # the timed runs' (the first call measured memory)
        row["cpu_s"], row["cpu_ratio"] = worst_rank(
            [statistics.median(mine), statistics.median(t / t0 for t, t0 in zip(mine, base_cpu))], rt
        )
        print0(
            f"{name:10s} {method:42s} wall {row['time_s'] * 1e3:7.1f} ms ({row['paired_ratio']:.2f}x)  "
            f"CPU {row['cpu_s'] * 1e3:7.1f} ms ({row['cpu_ratio']:.2f}x)",
            highlight=False,
        )
    return got


def cpu_timed(fn, into: list[float]):
    """`fn`, noting the CPU seconds this process spent in each call (its threads too: gloo's among them). On a
    shared machine the wall clock is mostly the wait for a core; the CPU seconds are what the method costs."""

    def timed():
        start = time.process_time()
        fn()
        into.append(time.process_time() - start)

    return timed


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--val-n", type=positive_int, default=4096, help="N of the validation row")
    parser.add_argument("--step-n", type=positive_int, default=1024, help="N of the step row")
    parser.add_argument("--dim", type=positive_int, default=256, help="d, the embedding width")
    parser.add_argument("--stream-chunk", type=positive_int, default=512, help="T: tiles are at most T x T")
    parser.add_argument("--check-tensors", type=positive_int, default=8, help="gradients of 2^20 in the check row")
    parser.add_argument("--repeats", type=positive_int, default=7, help="timed runs per method")
    parser.add_argument("--rows", nargs="+", choices=ROWS, default=list(ROWS), help="which rows to run")
    return add_runtime_args(parser).parse_args()


def main() -> int:
    args = parse_args()
    with distributed(args.device) as rt:
        meta = {"world": rt.world_size, "device": device_name(rt), "torch": torch.__version__, "backend": rt.backend}
        meta["command"] = f"torchrun --standalone --nproc-per-node {rt.world_size} benchmarks/loss_module_costs.py"
        meta["command"] += "".join(f" {a}" for a in sys.argv[1:])
        meta["load_average_before"] = os.getloadavg()[0]
        sizes = {"validation": f"N={args.val_n}", "step": f"N={args.step_n}", "check": f"{args.check_tensors} x 2^20"}
        rows = {f"{row} {sizes[row]}": run_row(row, ROWS[row](args, rt), args, rt) for row in args.rows}
        meta["load_average_after"] = os.getloadavg()[0]
        if rt.is_first:
            suffix = "" if args.rows == list(ROWS) else "_" + "_".join(args.rows)
            out = RESULTS / f"loss_module_costs_p{rt.world_size}{suffix}.json"
            out.write_text(json.dumps({"meta": meta, "args": vars(args), "rows": rows}, indent=1))
            print0(f"wrote {out} (load average {meta['load_average_before']:.1f} before)", highlight=False)
    return 0


if __name__ == "__main__":
    run_main(main)
