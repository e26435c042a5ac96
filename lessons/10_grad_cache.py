"""Lesson 10: GradCache. A contrastive batch far larger than fits, in chunks, with exact gradients.

    torchrun --nproc-per-node 2 lessons/10_grad_cache.py

The idea. The CLIP loss couples all N samples, so its gradient cannot be summed from micro-batches. But
the parameters reach the loss only through the representations r_i = f(x_i), N x d numbers, and

    dL/dtheta = sum_i (dL/dr_i) . (dr_i/dtheta).

GradCache (Gao et al. 2021; `distlab.contrastive.grad_cache`) computes it in three steps: (1) all
representations, chunk by chunk, without a graph; (2) the loss on them and its gradient G = dL/dR,
the cache; (3) every chunk again, with a graph, back-propagating <r_chunk, G_chunk>. Activations live
for one chunk at a time; dropout draws the same masks in (1) and (3) because each chunk's random state
is saved in (1) and replayed in (3) (`RandContext`).

Part 1, one process (rank 0): a batch of N = 512 pairs in chunks of 32. The gradients equal the full
batch's (a deep copy, plain autograd, the chunks with grad in the same order and seeds, so dropout
draws the same masks); the peak memory follows the chunk, not the batch, down to a floor set by the
loss's own N x N logits; and the price is time: an extra no-grad forward per step.

Part 2, P ranks under DDP: each rank runs GradCache on its N/P pairs, the loss gathers the
representations with lesson 09's gather (backward sums over ranks) and takes its C x N rows; DDP
averages. The gradients equal the single-process global batch's, and with `no_sync_except_last` each
model's gradients are all-reduced once per step, counted by a DDP communication hook.

What seed 002 got wrong: it says GradCache with chunk = batch "degenerates to plain training"; it
still runs every sample twice (the timing table shows it). It promises "memory for 2 samples only",
forgetting the loss: GradCache still builds the N x N (under DDP C x N) logits, the largest tensor of
the step, which lesson 11 removes. And its wrapper's RandContext comes from a library whose functional
API saves no CUDA state (ours saves every device the chunk lives on).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from rich.progress import track
from rich.table import Table
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from distlab.cli import DTYPES
from distlab.compare import all_ok, compare, comparison_table, grads_of, tolerances
from distlab.contrastive.gather import gather_with_grad
from distlab.contrastive.grad_cache import GradCache
from distlab.contrastive.losses import clip_loss, local_clip_loss
from distlab.memory import PeakMemory
from distlab.models import TwoTower, paired_data
from distlab.runtime import add_runtime_args, all_ranks_true, distributed, print0, run_main

MIB = 2 ** 20


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-size", type=int, default=512, help="part 1: pairs in the batch")
    parser.add_argument("--chunk-size", type=int, default=32, help="part 1: pairs per GradCache chunk")
    parser.add_argument("--dim", type=int, default=128, help="part 1: input features per view")
    parser.add_argument("--hidden", type=int, default=2048, help="part 1: hidden width of each tower")
    parser.add_argument("--memory-chunks", default="512,128,32,8", help="part 1: chunk sizes to measure")
    parser.add_argument("--memory-batches", default="64,128,256,512,1024",
                        help="part 1: batch sizes to measure, plain vs GradCache at --chunk-size")
    parser.add_argument("--repeats", type=int, default=3, help="part 1: timed steps per method (median)")
    parser.add_argument("--ddp-batch-size", type=int, default=64, help="part 2: global batch, P divides it")
    parser.add_argument("--ddp-chunk-size", type=int, default=12, help="part 2: chunk per rank")
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--tau", type=float, default=0.1, help="temperature")
    parser.add_argument("--dtype", choices=DTYPES, default="float64")
    parser.add_argument("--memory-json", help="write part 1's memory measurements here (rank 0)")
    return add_runtime_args(parser).parse_args()


def rep_clip_loss(rep_x: torch.Tensor, rep_y: torch.Tensor, tau: float) -> torch.Tensor:
    """CLIP loss on raw tower outputs (normalising is part of the loss, so part of the cache)."""
    return clip_loss(F.normalize(rep_x, dim=-1), F.normalize(rep_y, dim=-1), tau)


def ddp_rep_clip_loss(rep_x: torch.Tensor, rep_y: torch.Tensor, tau: float) -> torch.Tensor:
    """This rank's C rows of the global loss; the gather's backward sums over ranks (lesson 09)."""
    z_x, z_y = F.normalize(rep_x, dim=-1), F.normalize(rep_y, dim=-1)
    return local_clip_loss(z_x, z_y, gather_with_grad(z_x), gather_with_grad(z_y), tau,
                           offset=dist.get_rank() * len(z_x))


def chunked_reference(model: TwoTower, shards: list[tuple[torch.Tensor, torch.Tensor]], chunk: int,
                      tau: float, seeds: list[int]) -> tuple[dict[str, torch.Tensor], float]:
    """Plain autograd on a deep copy, one loss over the whole (global) batch. Shard s's chunks run
    with grad from seed s, tower x then tower y, as GradCache's first pass draws them: same masks."""
    ref = copy.deepcopy(model)
    reps_x, reps_y = [], []
    for (x, y), seed in zip(shards, seeds):
        torch.manual_seed(seed)
        reps_x += [ref.encoder_x(c) for c in x.split(chunk)]
        reps_y += [ref.encoder_y(c) for c in y.split(chunk)]
    loss = rep_clip_loss(torch.cat(reps_x), torch.cat(reps_y), tau)
    loss.backward()
    return grads_of(ref), loss.item()


# --- part 1: one process ---------------------------------------------------------------------------


def plain_step(model: TwoTower, x, y, tau: float) -> None:
    rep_clip_loss(model.encoder_x(x), model.encoder_y(y), tau).backward()


def cache_step(model: TwoTower, x, y, tau: float, chunk: int) -> torch.Tensor:
    return GradCache([model.encoder_x, model.encoder_y], chunk, rep_clip_loss)(x, y, tau=tau)


def peak(model: TwoTower, step, *args) -> tuple[float, float]:
    """(peak, largest tensor) in MiB of one step, parameter gradients included."""
    model.zero_grad(set_to_none=True)
    with PeakMemory() as mem:
        step(model, *args)
    return mem.peak_bytes / MIB, mem.largest_bytes / MIB


def seconds(model: TwoTower, step, *args, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        step(model, *args)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def part_one(args, dtype) -> bool:
    n, c, tau = args.batch_size, args.chunk_size, args.tau
    model = TwoTower(dim_x=args.dim, dim_y=args.dim, hidden=args.hidden, embed_dim=64,
                     dropout=args.dropout, seed=args.seed, dtype=dtype)
    x, y = paired_data(n, dim_x=args.dim, dim_y=args.dim, seed=args.seed, dtype=dtype)
    print0(f"\n[bold]Part 1, one process[/]: N = {n} pairs, chunks of {c}, towers {args.dim} -> "
           f"{args.hidden} -> 64, dropout {args.dropout}, {args.dtype}")

    ref_grads, ref_loss = chunked_reference(model, [(x, y)], c, tau, seeds=[args.seed + 1])
    torch.manual_seed(args.seed + 1)
    loss = cache_step(model, x, y, tau, c).item()
    rows = compare(ref_grads, grads_of(model))
    rtol, atol = tolerances(dtype)
    print0(comparison_table(rows, f"GradCache ({(n + c - 1) // c} chunks) vs the full batch",
                            caption=f"allclose with rtol {rtol:g}, atol {atol:g}; loss {loss:.12f} vs "
                                    f"{ref_loss:.12f}"))
    exact = all_ok(rows) and abs(loss - ref_loss) <= rtol * abs(ref_loss)

    # Memory against the chunk size, at this batch.
    chunks = [int(v) for v in args.memory_chunks.split(",")]
    plain_mib, plain_largest = peak(model, plain_step, x, y, tau)
    grads_mib = sum(p.numel() * p.element_size() for p in model.parameters()) / MIB
    table = Table(title=f"Peak memory of one step, N = {n} (tensor storage, PeakMemory)", title_justify="left",
                  caption=f"every step also allocates the parameter gradients: {grads_mib:.1f} MiB",
                  caption_justify="left")
    for col in ("method", "peak MiB", "largest tensor MiB"):
        table.add_column(col, justify="left" if col == "method" else "right")
    table.add_row("plain autograd", f"{plain_mib:.1f}", f"{plain_largest:.1f}")
    by_chunk = {}
    for chunk in track(chunks, description="memory vs chunk", disable=dist.get_rank() != 0):
        by_chunk[chunk] = peak(model, cache_step, x, y, tau, chunk)
        table.add_row(f"GradCache, chunk {chunk}", *(f"{v:.1f}" for v in by_chunk[chunk]))
    logits_mib = n * n * x.element_size() / MIB
    print0(table)
    print0(f"At chunk {min(chunks)} the largest tensor, {by_chunk[min(chunks)][1]:.1f} MiB, is the loss's N x N "
           f"logits ({n} x {n} x {x.element_size()} B = {logits_mib:.1f} MiB): GradCache shrinks the activations, "
           "not the loss, which sets the floor (lesson 11 removes it).")
    memory_ok = by_chunk[min(chunks)][0] < plain_mib

    # Memory against the batch size, plain vs GradCache at chunk c.
    batches = [int(v) for v in args.memory_batches.split(",")]
    by_batch = {"batch": batches, "plain": [], "grad_cache": [], "chunk": c}
    table = Table(title=f"Peak MiB against batch size, GradCache at chunk {c}", title_justify="left")
    for col in ("N", "plain", "GradCache", "N x N logits"):
        table.add_column(col, justify="right")
    for b in track(batches, description="memory vs batch", disable=dist.get_rank() != 0):
        xb, yb = paired_data(b, dim_x=args.dim, dim_y=args.dim, seed=args.seed, dtype=dtype)
        by_batch["plain"].append(peak(model, plain_step, xb, yb, tau)[0])
        by_batch["grad_cache"].append(peak(model, cache_step, xb, yb, tau, min(c, b))[0])
        table.add_row(str(b), f"{by_batch['plain'][-1]:.1f}", f"{by_batch['grad_cache'][-1]:.1f}",
                      f"{b * b * x.element_size() / MIB:.1f}")
    print0(table)
    if args.memory_json:
        with open(args.memory_json, "w") as f:
            json.dump({"by_chunk": {"batch": n, "plain": plain_mib, **{str(k): v[0] for k, v in by_chunk.items()}},
                       "by_batch": by_batch, "parameter_gradients": grads_mib}, f)

    # The price: time of a step at the same batch.
    reps = args.repeats
    with torch.no_grad():
        forward = seconds(model, lambda m, a, b: (m.encoder_x(a), m.encoder_y(b)), x, y, repeats=reps)
    plain_s = seconds(model, plain_step, x, y, tau, repeats=reps)
    full_s = seconds(model, cache_step, x, y, tau, n, repeats=reps)
    chunk_s = seconds(model, cache_step, x, y, tau, c, repeats=reps)
    table = Table(title=f"Time of one step, N = {n} (median of {reps}, one thread)", title_justify="left")
    for col in ("step", "seconds", "vs plain"):
        table.add_column(col, justify="left" if col == "step" else "right")
    for name, s in (("no-grad forward alone", forward), ("plain autograd", plain_s),
                    (f"GradCache, chunk {n} (= N)", full_s), (f"GradCache, chunk {c}", chunk_s)):
        table.add_row(name, f"{s:.3f}", f"{s / plain_s:.2f}x")
    print0(table)
    print0(f"GradCache = plain + one no-grad forward: predicted {(plain_s + forward) / plain_s:.2f}x at chunk = N, "
           "which is not plain training: it still runs every sample twice. Small chunks cost more again: every "
           "chunk's backward adds into the whole parameter gradient, and small matrix products use the "
           "hardware worse than large ones.")
    print0(f"[bold]Part 1 {'PASS' if exact and memory_ok else 'FAIL'}[/]: gradients "
           f"{'equal' if exact else 'DO NOT equal'} the full batch's; peak memory at chunk {min(chunks)} "
           f"{'below' if memory_ok else 'NOT below'} plain autograd's")
    return exact and memory_ok


# --- part 2: DDP -------------------------------------------------------------------------------------


def count_reductions(model: DDP) -> dict:
    """A DDP comm hook that counts the gradient buckets it all-reduces, then all-reduces them."""
    counter = {"all_reduces": 0}

    def hook(state: dict, bucket):
        state["all_reduces"] += 1
        return default_hooks.allreduce_hook(None, bucket)

    model.register_comm_hook(counter, hook)
    return counter


def part_two(args, dtype, rt) -> bool:
    p, n = rt.world_size, args.ddp_batch_size
    local, c, tau = n // p, args.ddp_chunk_size, args.tau
    model = TwoTower(dim_x=12, dim_y=10, hidden=64, embed_dim=16, dropout=args.dropout,
                     seed=args.seed, dtype=dtype)
    x, y = paired_data(n, seed=args.seed + 7, dtype=dtype)
    shards = [(x[r * local:(r + 1) * local], y[r * local:(r + 1) * local]) for r in range(p)]
    seeds = [args.seed + 100 + r for r in range(p)]  # each rank's dropout stream
    print0(f"\n[bold]Part 2, DDP on {p} rank(s)[/]: global batch {n}, {local} pairs per rank in chunks "
           f"of {c}, dropout {args.dropout}, {args.dtype}, backend {rt.backend}")
    ref_grads, ref_loss = chunked_reference(model, shards, c, tau, seeds)

    towers = [DDP(copy.deepcopy(model.encoder_x)), DDP(copy.deepcopy(model.encoder_y))]
    counters = [count_reductions(t) for t in towers]
    mine = shards[rt.rank]
    ok, counts = True, {}
    rtol, atol = tolerances(dtype)
    for sync_last in (True, False):
        for t, k in zip(towers, counters):
            t.zero_grad(set_to_none=True)
            k["all_reduces"] = 0
        torch.manual_seed(seeds[rt.rank])
        cache = GradCache(towers, c, ddp_rep_clip_loss)
        with PeakMemory() as mem:
            loss = cache(*mine, no_sync_except_last=sync_last, tau=tau)
        counts[sync_last] = [k["all_reduces"] for k in counters]
        got = {**grads_of(towers[0].module, "encoder_x."), **grads_of(towers[1].module, "encoder_y.")}
        rows = compare(ref_grads, got)
        global_loss = loss.clone()
        dist.all_reduce(global_loss)
        global_loss = global_loss.item() / p  # the mean of the P local losses is the global loss
        if sync_last:
            print0(comparison_table(rows, "GradCache under DDP vs the single-process global batch (rank 0)",
                                    caption=f"allclose with rtol {rtol:g}, atol {atol:g}; loss {global_loss:.12f}"
                                            f" vs {ref_loss:.12f}"))
        ok &= all_ok(rows) and abs(global_loss - ref_loss) <= rtol * abs(ref_loss)
    chunks = (local + c - 1) // c
    table = Table(title="Gradient all-reduces in one step (DDP comm hook calls), per tower", title_justify="left")
    for col in ("no_sync_except_last", "encoder_x", "encoder_y", "expected"):
        table.add_column(col, justify="right")
    table.add_row("True", *map(str, counts[True]), "1 each")
    table.add_row("False", *map(str, counts[False]), f"{chunks} each (one per chunk)")
    print0(table)
    print0(f"Largest tensor of rank 0's step: {mem.largest_bytes / MIB * 1024:.1f} KiB; the C x N logits are "
           f"{local} x {n} x {x.element_size()} B = {local * n * x.element_size() / 1024:.1f} KiB.")
    once = counts[True] == [1, 1]
    print0(f"[bold]Part 2 {'PASS' if ok and once else 'FAIL'}[/]: gradients {'equal' if ok else 'DO NOT equal'} "
           f"the global batch's (with and without no_sync_except_last); "
           f"{'one all-reduce' if once else f'{counts[True]} all-reduces'} per tower with no_sync_except_last")
    return ok and once


def main() -> int:
    args = parse_args()
    dtype = DTYPES[args.dtype]
    for name in ("batch_size", "chunk_size", "ddp_batch_size", "ddp_chunk_size", "repeats"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    with distributed(args.device) as rt:
        if args.ddp_batch_size % rt.world_size:
            raise ValueError(f"--ddp-batch-size {args.ddp_batch_size} must be divisible by the world "
                             f"size {rt.world_size}")
        print0(f"[bold]Lesson 10: GradCache[/] - {rt.world_size} rank(s), backend {rt.backend}")
        # Part 1 runs on rank 0 alone (its timings would fight the other ranks for the cores).
        first = part_one(args, dtype) if rt.is_first else True
        dist.barrier()
        second = part_two(args, dtype, rt)
        ok = all_ranks_true(first and second)
        print0(f"\n[bold]{'PASS' if ok else 'FAIL'}[/]: GradCache gives the full batch's gradients in one "
               "process and the global batch's under DDP, with memory set by the chunk")
    return 0 if ok else 1


if __name__ == "__main__":
    run_main(main)
