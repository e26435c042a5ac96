"""A whole CLIP training step at large N: open_clip's recipe against the streamed step, and the loss
machinery against the matmul floor, per-rank time and peak memory.

    torchrun --standalone --nproc-per-node 2 benchmarks/clip_step.py      # P = 2, N = 1024 ... 16384
    python benchmarks/clip_step.py --report                                # tables and plot from the JSON

Step (a small two-tower encoder, 64 -> 256 -> d per tower, d = 256, AdamW, float32, tau = 0.07):
  open_clip recipe   one forward; both towers' C x d embeddings gathered with the sum-backward gather
                     (`distlab.contrastive.gather.gather_with_grad`, lesson 12); the C x N local loss
                     (`losses.local_clip_loss`); backward; step. open_clip's
                     ClipLoss(local_loss=True, gather_with_grad=True) under DDP.
  streamed, B = C    `distributed_backward` with MICRO_BATCH_SIZE = C (one forward, the graph kept); step
  streamed, B = C/8  eight micro-batches (a no-grad forward, then a recompute of each); step
Loss machinery (this rank's C x d embeddings in, dL/dZ_local out; no encoder):
  open_clip recipe   gather_with_grad, local_clip_loss, backward to the embeddings
  streamed           the library's `streamed.loss_machinery`: the all-gather, phase 2, and phase 3
                     for every micro-batch (B = C and B = C/8), as the step runs them
  matmul floor       the same 6 C N d multiply-adds as plain `mm` in C x T tiles (2 C N d for the
                     rows and columns of S, 2 x 2 C N d for the two tile products and accumulations of
                     G): no exponentials, no reductions, no communication. It is timed in both parts,
                     interleaved with the methods, and every time in the tables is printed with its
                     ratio to the floor of the same part and N.

Memory: the peak of tensor storage a call allocated on a rank (`distlab.memory.PeakMemory`; also
`torch.cuda.max_memory_allocated` on GPUs), the worst rank, in its own run (watching every op slows
small ones down). Time: the wall clock of the slowest rank, median of --repeats, the methods
interleaved at each N so that load on a shared machine hits them alike. Before timing, the methods'
gradients are checked to agree at the smallest N (the benchmark compares exact methods only).
Writes benchmarks/results/clip_step_p{P}.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from distlab.chunks import chunks
from distlab.cli import add_runtime_args, positive_int
from distlab.console import print0
from distlab.contrastive.gather import gather_with_grad
from distlab.contrastive.losses import local_clip_loss
from distlab.models import TwoTower
from distlab.runtime import distributed, run_main
from distlab.streamed import loss_machinery
from distributed_clip import distributed_backward

sys.path.insert(0, str(Path(__file__).parent))
from clip_step_report import B_C8, B_EQ_C, FLOOR, OPEN_CLIP, write_report  # noqa: E402
from measure import local_embeddings, measure_interleaved  # noqa: E402

RESULTS = Path(__file__).parent / "results"
TAU = 0.07
STEP_METHODS = (OPEN_CLIP, B_EQ_C, B_C8)
LOSS_METHODS = (OPEN_CLIP, B_EQ_C, B_C8, FLOOR)


def config(n: int, micro: int, chunk: int) -> dict:
    return {"GLOBAL_BATCH_SIZE": n, "MICRO_BATCH_SIZE": micro, "STREAM_CHUNK_SIZE": chunk, "TAU": TAU}


def micro_of(method: str, c: int) -> int:
    return c if method == B_EQ_C else max(1, c // 8)


# ---------------------------------------------------------------------------------------------
# The loss machinery: this rank's C x d embeddings in, dL/dZ_local out
# ---------------------------------------------------------------------------------------------


def loss_open_clip(z_x, z_y, rt, chunk, method):
    lx, ly = z_x.clone().requires_grad_(), z_y.clone().requires_grad_()
    loss = local_clip_loss(lx, ly, gather_with_grad(lx), gather_with_grad(ly), 1 / TAU, rt.rank * len(z_x))
    loss.backward()
    return lx.grad / rt.world_size, ly.grad / rt.world_size  # DDP's average: the mean of P local losses


def loss_streamed(z_x, z_y, rt, chunk, method):
    c = len(z_x)
    _, g_x, g_y = loss_machinery(z_x, z_y, config(c * rt.world_size, micro_of(method, c), chunk))
    return g_x, g_y


def matmul_floor(z_x, z_y, rt, chunk, method):
    """6 C N d multiply-adds as plain mm on the gathered embeddings, in C x T tiles (not a gradient)."""
    k_x, k_y = z_x.repeat(rt.world_size, 1), z_y.repeat(rt.world_size, 1)  # N x d: stand-ins for the gather
    g_x, g_y = torch.zeros_like(z_x), torch.zeros_like(z_y)
    tile = z_x.new_empty(len(z_x), min(chunk, len(k_x)))
    for cols in chunks(len(k_x), chunk):                   # phase 2's 2 C N d: my rows and my columns of S
        width = cols.stop - cols.start
        torch.mm(z_x, k_y[cols].T, out=tile[:, :width])
        torch.mm(z_y, k_x[cols].T, out=tile[:, :width])
    for cols in chunks(len(k_x), chunk):                   # phase 3's 4 C N d: a tile and its product
        width = cols.stop - cols.start
        g_x.addmm_(torch.mm(z_x, k_y[cols].T, out=tile[:, :width]), k_y[cols])
        g_y.addmm_(torch.mm(z_y, k_x[cols].T, out=tile[:, :width]), k_x[cols])
    return g_x, g_y


LOSSES = {OPEN_CLIP: loss_open_clip, B_EQ_C: loss_streamed, B_C8: loss_streamed, FLOOR: matmul_floor}


# ---------------------------------------------------------------------------------------------
# A whole training step
# ---------------------------------------------------------------------------------------------


def backward_open_clip(model, x, y, rt):
    """open_clip's ClipLoss(local_loss=True, gather_with_grad=True) and loss.backward() under DDP."""
    z_x, z_y = model(x, y)
    loss = local_clip_loss(z_x, z_y, gather_with_grad(z_x), gather_with_grad(z_y), 1 / TAU, rt.rank * len(x))
    loss.backward()
    return loss


def backward(method, model, x, y, rt, chunk):
    if method == OPEN_CLIP:
        return backward_open_clip(model, x, y, rt)
    return distributed_backward(model, x, y, config(len(x) * rt.world_size, micro_of(method, len(x)), chunk))


def train_step(method, model, optimizer, x, y, rt, chunk):
    optimizer.zero_grad(set_to_none=True)
    backward(method, model, x, y, rt, chunk)
    optimizer.step()


def make_model(args, rt) -> DDP:
    model = TwoTower(64, 64, hidden=256, embed_dim=args.dim, seed=args.seed, dtype=torch.float32)
    return DDP(model.to(rt.device), device_ids=[rt.local_rank] if rt.device.type == "cuda" else None)


def local_batch(n: int, rt, dim_in: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(n + rt.rank)
    return tuple(torch.randn(n // rt.world_size, dim_in, generator=gen).to(rt.device) for _ in range(2))


def check_agreement(args, rt) -> dict:
    """At the smallest N, every step method's parameter gradients and every loss method's dL/dZ
    (the floor aside) agree: the benchmark compares exact methods."""
    n = args.sizes[0]
    x, y = local_batch(n, rt)
    grads = {}
    for method in STEP_METHODS:
        model = make_model(args, rt)
        backward(method, model, x, y, rt, args.stream_chunk)
        grads[method] = torch.cat([p.grad.flatten() for p in model.parameters()])
    z = local_embeddings(n, args.dim, rt)
    losses = {m: torch.cat(LOSSES[m](*z, rt, args.stream_chunk, m)) for m in LOSS_METHODS if m != FLOOR}
    rel = lambda got, ref: ((got - ref).abs().max() / ref.abs().max()).item()  # noqa: E731
    return {"step": max(rel(grads[m], grads[OPEN_CLIP]) for m in STEP_METHODS),
            "loss": max(rel(losses[m], losses[OPEN_CLIP]) for m in losses)}


def calls_at(part: str, n: int, args, rt) -> dict:
    """method -> a zero-argument call that runs one step (or one loss machinery) at this N."""
    calls = {}
    if part == "loss":
        z = local_embeddings(n, args.dim, rt)
        for m in args.loss_methods:
            calls[m] = lambda m=m: LOSSES[m](*z, rt, args.stream_chunk, m)
        return calls
    x, y = local_batch(n, rt)
    for m in args.step_methods:
        model = make_model(args, rt)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        calls[m] = lambda m=m, model=model, opt=optimizer: train_step(m, model, opt, x, y, rt, args.stream_chunk)
    z = local_embeddings(n, args.dim, rt)  # the floor again, interleaved with the steps it is the yardstick of
    calls[FLOOR] = lambda: matmul_floor(*z, rt, args.stream_chunk, FLOOR)
    return calls


def run_part(part: str, args, rt) -> dict:
    results = {m: [] for m in (args.loss_methods if part == "loss" else [*args.step_methods, FLOOR])}
    for n in args.sizes:
        calls = calls_at(part, n, args, rt)
        for fn in calls.values():
            fn()  # warm-up: DDP's first iteration, AdamW's state, lazy allocations
        for m, got in measure_interleaved(calls, rt, args.repeats).items():
            results[m].append({"n": n, **got})
            print0(f"{part:4s} N={n:6d} {m:18s} peak {got['peak_bytes'] / 2**20:8.1f} MiB  "
                   f"time {got['time_s']:7.3f} s", highlight=False)
        del calls
    return results


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=positive_int, nargs="+", default=[1024, 2048, 4096, 8192, 16384],
                        help="global batches N")
    parser.add_argument("--dim", type=positive_int, default=256, help="d, the embedding width")
    parser.add_argument("--stream-chunk", type=positive_int, default=512, help="T: tiles are at most T x T")
    parser.add_argument("--repeats", type=positive_int, default=3, help="timed runs per method and N")
    parser.add_argument("--parts", nargs="+", choices=("step", "loss"), default=["step", "loss"])
    parser.add_argument("--step-methods", nargs="+", choices=STEP_METHODS, default=list(STEP_METHODS))
    parser.add_argument("--loss-methods", nargs="+", choices=LOSS_METHODS, default=list(LOSS_METHODS))
    parser.add_argument("--out", help="output path without suffix (default: results/clip_step_p{P})")
    parser.add_argument("--report", metavar="JSON", nargs="?", const=str(RESULTS / "clip_step_p2.json"),
                        help="only rewrite the Markdown table and the plot from this JSON")
    return add_runtime_args(parser).parse_args()


def device_name(rt) -> str:
    if rt.device.type == "cuda":
        return torch.cuda.get_device_name(rt.device)
    return (f"CPU {platform.machine()} ({torch.backends.cpu.get_cpu_capability()}), "
            f"{torch.get_num_threads()} thread(s) per rank")


def main() -> int:
    args = parse_args()
    if args.report:
        write_report(Path(args.report))
        return 0
    with distributed(args.device) as rt:
        if any(n % (8 * rt.world_size) for n in args.sizes):
            raise ValueError(f"--sizes: every N must be divisible by 8 P = {8 * rt.world_size} (B = C/8)")
        meta = {"world": rt.world_size, "dim": args.dim, "stream_chunk": args.stream_chunk, "dtype": "float32",
                "tau": TAU, "sizes": args.sizes, "repeats": args.repeats, "device": device_name(rt),
                "torch": torch.__version__, "backend": rt.backend,
                "command": f"torchrun --standalone --nproc-per-node {rt.world_size} benchmarks/clip_step.py "
                           + " ".join(sys.argv[1:])}
        agreement = check_agreement(args, rt)
        print0(f"methods agree at N={args.sizes[0]}: max relative difference, step gradients "
               f"{agreement['step']:.1e}, loss dL/dZ {agreement['loss']:.1e}")
        if max(agreement.values()) > 1e-4:
            raise RuntimeError(f"methods disagree ({agreement}): the benchmark would compare different things")
        meta["load_average_before"] = os.getloadavg()[0]  # the machine may be shared: say how busy it was
        results = {part: run_part(part, args, rt) for part in args.parts}
        meta["load_average_after"] = os.getloadavg()[0]
        if rt.is_first:
            out = Path(args.out) if args.out else RESULTS / f"clip_step_p{rt.world_size}"
            out.parent.mkdir(parents=True, exist_ok=True)
            out.with_suffix(".json").write_text(json.dumps(
                {"meta": meta, "agreement_max_rel": agreement, "results": results}, indent=1))
            text = write_report(out.with_suffix(".json"))
            print0(f"wrote {out}.{{json,md,png}}\n" + text[text.index("**Targets**"):], highlight=False,
                   soft_wrap=True)
    return 0


if __name__ == "__main__":
    run_main(main)
