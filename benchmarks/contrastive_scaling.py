"""Per-rank peak memory and time of exact contrastive (CLIP) training against the global batch N.

    torchrun --standalone --nproc-per-node 2 benchmarks/contrastive_scaling.py          # P = 2
    torchrun --standalone --nproc-per-node 4 benchmarks/contrastive_scaling.py --sizes 1024 2048 4096 8192

Methods, labelled by their lesson, all exact (their gradients are checked against each other at the
smallest N):
  10  global x global: every rank gathers Z and computes the whole N x N loss
  12  local x global: C x N logits, gather_with_grad (its backward sums over ranks)
  13  GradCache: the C x N loss on gathered cached representations and its backward (the loss
      machinery; its whole step adds the chunked no-grad forward and the chunked recompute)
  14  the streamed five-phase step, its phase 2 (the normalisers a, b) sharded and replicated

Two measurements per method and N. "loss": the machinery that turns this rank's C x d embeddings
into dL/dZ_local (gathers included). "step": a whole DDP training step of a small two-tower encoder
(64 -> 256 -> d per tower) on C pairs per rank, backward and SGD step included. Memory is the peak of
tensor storage the call allocated on this rank (`distlab.proof.memory.PeakMemory`, on any device; plus
`torch.cuda.max_memory_allocated` on GPUs), taken in its own run, since watching every op slows
small ops down; time is the wall clock of the slowest rank, the median of --repeats runs, methods
interleaved so that load on a shared machine hits them alike. A method is not run at an N where its
predicted peak (extrapolated from the two previous N with the measured exponent) exceeds --cap-gib.
Writes benchmarks/results/contrastive_scaling_p{P}.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from distlab.contrastive.gather import gather_plain, gather_with_grad
from distlab.contrastive.losses import clip_loss, local_clip_loss
from distlab.pieces.chunks import chunks
from distlab.processes.console import print0
from distlab.processes.runtime import distributed, run_main
from distlab.proof.cli import add_runtime_args
from distlab.proof.models import TwoTower
from distlab.streamed import loss_machinery
from distributed_clip import distributed_train_step

sys.path.insert(0, str(Path(__file__).parent))
from measure import local_embeddings, measure_interleaved  # noqa: E402
from scaling_report import summarise, targets, write_markdown, write_plot  # noqa: E402

RESULTS = Path(__file__).parent / "results"


@dataclass(frozen=True)
class At:
    """Where a method runs: the global batch N, this rank of P, the micro-batch B and the chunk T."""

    n: int
    rank: int
    world: int
    micro: int
    chunk: int


METHODS = ("10 global x global", "12 local x global", "13 GradCache", "14 streamed, sharded", "14 streamed, replicated")
TAU = 0.07


# ---------------------------------------------------------------------------------------------
# The loss machinery: this rank's C x d embeddings in, dL/dZ_local out (up to each method's scale)
# ---------------------------------------------------------------------------------------------


def loss_10(z_x, z_y, at: At):
    lx, ly = z_x.clone().requires_grad_(), z_y.clone().requires_grad_()
    clip_loss(gather_plain(lx), gather_plain(ly), 1 / TAU).backward()  # the whole N x N on every rank
    return lx.grad, ly.grad


def loss_12(z_x, z_y, at: At):
    lx, ly = z_x.clone().requires_grad_(), z_y.clone().requires_grad_()
    c = len(z_x)
    local_clip_loss(lx, ly, gather_with_grad(lx), gather_with_grad(ly), 1 / TAU, at.rank * c).backward()
    return lx.grad / at.world, ly.grad / at.world  # the mean of the P local losses is L


def loss_13(z_x, z_y, at: At):
    # GradCache: the representations were computed without grad and cached; the loss runs on them
    # as leaves, and their gradient is what the chunked recompute will back-propagate.
    reps_x, reps_y = z_x.detach().requires_grad_(), z_y.detach().requires_grad_()
    c = len(z_x)
    loss = local_clip_loss(reps_x, reps_y, gather_with_grad(reps_x), gather_with_grad(reps_y), 1 / TAU, at.rank * c)
    loss.backward()
    return reps_x.grad / at.world, reps_y.grad / at.world


def _loss_14(z_x, z_y, at: At, variant: str):
    _, g_x, g_y = loss_machinery(
        z_x,
        z_y,
        {
            "GLOBAL_BATCH_SIZE": at.n,
            "MICRO_BATCH_SIZE": at.micro,
            "STREAM_CHUNK_SIZE": at.chunk,
            "TAU": TAU,
            "NORMALISERS": variant,
        },
    )
    return g_x, g_y


LOSSES = dict(
    zip(
        METHODS,
        (
            loss_10,
            loss_12,
            loss_13,
            lambda *a: _loss_14(*a, variant="sharded"),
            lambda *a: _loss_14(*a, variant="replicated"),
        ),
    )
)


# ---------------------------------------------------------------------------------------------
# A whole training step with a small encoder
# ---------------------------------------------------------------------------------------------


def step_fn(method, model, optimizer, x, y, at: At):
    c = len(x)
    if method.startswith("14"):
        variant = "sharded" if "sharded" in method else "replicated"
        return distributed_train_step(
            model,
            optimizer,
            x,
            y,
            {
                "GLOBAL_BATCH_SIZE": at.n,
                "MICRO_BATCH_SIZE": at.micro,
                "STREAM_CHUNK_SIZE": at.chunk,
                "TAU": TAU,
                "NORMALISERS": variant,
            },
        )
    optimizer.zero_grad(set_to_none=True)
    if method.startswith("13"):  # chunked no-grad forward, loss on cached reps, chunked recompute
        with torch.no_grad():
            reps = [model.module(x[s], y[s]) for s in chunks(c, at.micro)]
        rx, ry = (torch.cat([r[i] for r in reps]).requires_grad_() for i in (0, 1))
        loss = local_clip_loss(rx, ry, gather_with_grad(rx), gather_with_grad(ry), 1 / TAU, at.rank * c)
        loss.backward()
        parts = chunks(c, at.micro)
        for k, s in enumerate(parts):
            ctx = model.no_sync() if k < len(parts) - 1 else torch.enable_grad()
            with ctx:
                zx, zy = model(x[s], y[s])
                torch.autograd.backward((zx, zy), (rx.grad[s], ry.grad[s]))
    else:
        zx, zy = model(x, y)
        if method.startswith("10"):
            loss = clip_loss(gather_plain(zx), gather_plain(zy), 1 / TAU) * at.world  # DDP averages P copies
        else:
            loss = local_clip_loss(zx, zy, gather_with_grad(zx), gather_with_grad(zy), 1 / TAU, at.rank * c)
        loss.backward()
    optimizer.step()
    return loss.item()


# ---------------------------------------------------------------------------------------------
# Measuring
# ---------------------------------------------------------------------------------------------


def predicted_peak(history: list[tuple[int, int]], n: int) -> float | None:
    """Extrapolate from the last two measured (N, peak) with their own exponent."""
    if len(history) < 2:
        return None
    (n0, p0), (n1, p1) = history[-2:]
    slope = math.log(p1 / p0) / math.log(n1 / n0)
    return p1 * (n / n1) ** slope


def check_methods_agree(rt, args, dtype) -> float:
    """At the smallest N every method's dL/dZ_local is the same: the benchmark compares exact methods."""
    n = args.sizes[0]
    at = At(n, rt.rank, rt.world_size, args.micro, args.chunk)
    z_x, z_y = local_embeddings(n, args.dim, rt, dtype)
    ref = torch.cat(loss_12(z_x, z_y, at))
    worst = 0.0
    for method in args.methods:
        got = torch.cat(LOSSES[method](z_x, z_y, at))
        worst = max(worst, ((got - ref).abs().max() / ref.abs().max()).item())
    return worst


def run_part(part: str, rt, args, dtype) -> dict:
    results = {m: [] for m in args.methods}
    for n in args.sizes:
        c, at = n // rt.world_size, At(n, rt.rank, rt.world_size, args.micro, args.chunk)
        calls, models = {}, {}
        for method in args.methods:
            done = [(r["n"], r["peak_bytes"]) for r in results[method] if "peak_bytes" in r]
            guess = predicted_peak(done, n)
            if guess is not None and guess > args.cap_gib * 2**30 or any(r.get("skipped") for r in results[method]):
                results[method].append({"n": n, "skipped": True, "predicted_peak_bytes": guess})
                continue
            if part == "loss":
                z = local_embeddings(n, args.dim, rt, dtype)
                calls[method] = lambda m=method, z=z, at=at: LOSSES[m](*z, at)
            else:
                gen = torch.Generator().manual_seed(n + rt.rank)
                x, y = (torch.randn(c, 64, generator=gen, dtype=dtype).to(rt.device) for _ in range(2))
                model = DDP(
                    TwoTower(64, 64, hidden=256, embed_dim=args.dim, dtype=dtype).to(rt.device),
                    device_ids=[rt.local_rank] if rt.device.type == "cuda" else None,
                )
                opt = torch.optim.SGD(model.parameters(), lr=1e-3)
                models[method] = model
                calls[method] = lambda m=method, model=model, opt=opt, x=x, y=y, at=at: step_fn(m, model, opt, x, y, at)
                calls[method]()  # warm-up: DDP's first iteration, lazy allocations
        for m, got in measure_interleaved(calls, rt, args.repeats).items():
            results[m].append({"n": n, **got})
            print0(
                f"{part:4s} N={n:6d} {m:26s} peak {got['peak_bytes'] / 2**20:9.1f} MiB  "
                f"largest {got['largest_bytes'] / 2**20:9.1f} MiB  time {got['time_s']:8.3f} s"
            )
        del calls, models
    return results


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--micro", type=int, default=512, help="B for lessons 24 and 25")
    parser.add_argument("--chunk", type=int, default=2048, help="T for lesson 25: its tiles are at most T x T")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cap-gib", type=float, default=4.0, help="per-rank peak memory cap")
    parser.add_argument("--parts", nargs="+", choices=("loss", "step"), default=["loss", "step"])
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    parser.add_argument("--out", help="output path without suffix (default: results/contrastive_scaling_p{P})")
    return add_runtime_args(parser).parse_args()


def main() -> int:
    args = parse_args()
    dtype = getattr(torch, args.dtype)
    with distributed(args.device) as rt:
        if any(n % rt.world_size for n in args.sizes):
            raise ValueError(f"every N in --sizes must be divisible by P={rt.world_size}")
        device = (
            torch.cuda.get_device_name(rt.device)
            if rt.device.type == "cuda"
            else f"CPU {platform.machine()} ({torch.backends.cpu.get_cpu_capability()}), "
            f"{torch.get_num_threads()} thread(s) per rank"
        )
        meta = {
            "world": rt.world_size,
            "dim": args.dim,
            "micro": args.micro,
            "chunk": args.chunk,
            "dtype": args.dtype,
            "tau": TAU,
            "cap_gib": args.cap_gib,
            "sizes": args.sizes,
            "repeats": args.repeats,
            "device": device,
            "torch": torch.__version__,
            "backend": rt.backend,
            "command": f"torchrun --standalone --nproc-per-node {rt.world_size} benchmarks/contrastive_scaling.py "
            + " ".join(sys.argv[1:]),
        }
        worst = check_methods_agree(rt, args, dtype)
        print0(f"all methods' dL/dZ_local agree at N={args.sizes[0]}: max relative difference {worst:.1e}")
        if worst > (1e-4 if dtype == torch.float32 else 1e-10):
            raise RuntimeError(f"methods disagree ({worst:.1e}): the benchmark would compare different things")
        results = {part: run_part(part, rt, args, dtype) for part in args.parts}
        summary = summarise(results, args.cap_gib * 2**30)
        goals = targets(results) if "loss" in results else {}
        if rt.is_first:
            out = Path(args.out) if args.out else RESULTS / f"contrastive_scaling_p{rt.world_size}"
            out.parent.mkdir(parents=True, exist_ok=True)
            payload = {
                "meta": meta,
                "agreement_max_rel": worst,
                "results": results,
                "summary": summary,
                "targets": goals,
            }
            out.with_suffix(".json").write_text(json.dumps(payload, indent=1))
            write_markdown(out.with_suffix(".md"), meta, results, summary, goals)
            write_plot(out.with_suffix(".png"), meta, results)
            print0(out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    run_main(main)
