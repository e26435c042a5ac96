"""A CLIP batch one GPU could not hold: open_clip's ViT-B-32 trained at P = 1 by open_clip's own recipe and by
`distributed_train_step`, at the largest batch the recipe fits, then at 4x and 16x that batch.

    torchrun --standalone --nproc-per-node 1 benchmarks/clip_batch.py OUT                 # one GPU, ViT-B-32
    torchrun --standalone --nproc-per-node 1 benchmarks/clip_batch.py OUT --memory-gib 40 # as if it had 40 GiB
    torchrun --standalone --nproc-per-node 1 benchmarks/clip_batch.py OUT --cpu-dry-run   # tiny model, CPU

The model: `open_clip.create_model("ViT-B-32")` with random weights (no download), bf16 autocast, AdamW; the
inputs random images (3 x 224 x 224) and random token ids (77), so only the arithmetic is timed. The dry run
(no open_clip on the CPU here) puts a tiny two-tower model with open_clip's output dict in its place.

open_clip's recipe at P = 1: one forward of the whole batch, the N x N logits s Z_x Z_y^T, the symmetric
cross entropy (what `open_clip.loss.ClipLoss` computes on one rank), backward, step. Its memory grows with N:
every activation of both towers for all N pairs plus the N x N logits. `distributed_train_step` with B rows per
micro-batch keeps one micro-batch's activations and the O(N d) embeddings (a no-grad forward of each
micro-batch, the exact loss gradient dL/dZ streamed, then each micro-batch again with grad: about 4/3 the
recipe's tower FLOPs; with B = N one forward, its graph kept, as the recipe), at MATMUL_PRECISION "bf16" (KERNELS
"auto": the Triton kernels with W in memory on CUDA). B defaults to N_max at N_max (one forward, as the recipe) and
to N_max / 2 above it: on an H200, B = N_max at 4 N_max ran out of memory (the recipe's B = N_max activations
leave no room for the step's own buffers and a second model's states).

0. Both models start from the same weights, and their first losses on one batch are printed side by side.
1. The recipe's largest batch N_max: its peak memory measured at two small batches, a straight line through
   them extrapolated to the device's memory (minus a reserve), rounded down to a multiple of 256, then run to
   confirm (halved until it runs). 2. At N_max both step times side by side, after a warm-up step. 3. At 4 N_max
   and 16 N_max the recipe is tried once (out of memory expected) and distlab's step timed, with its peak.
4. The ring at fixed N, P = 1, 2, 4, 8 simulated on this one card (`ring_sweep`): rank 0's share of the InfoNCE
   ring's loss machinery (`rank_work.one_rank`: its C x d blocks, its P visits, the exchange left out) at
   N = 16 N_max and d = 512 (ViT-B-32's embedding width), its peak memory counted (`PeakMemory`, and on CUDA the
   allocator's peak) plus the blocks in flight that the ring would receive (features and accumulator, C d each,
   by formula: the one-process walk hands its own blocks back). What scales with C falls as 1/P; one chunk of S
   or W (W_MEMORY_MIB, 64 MiB here, so the C-sized terms show) does not.
Writes OUT/clip_batch.json and OUT/clip_batch.md (the card named in both).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distlab.processes.runtime import distributed, run_main
from distlab.proof.memory import PeakMemory
from distlab.streamed.config import parse_config
from distlab.streamed.kernel_choice import tile_ops
from distlab.streamed.rank_work import one_rank
from distributed_clip import distributed_train_step

IMAGE, CONTEXT, VOCAB = 224, 77, 49408  # open_clip's ViT-B-32 inputs
EMBED, SWEEP_MIB = 512, 64  # ViT-B-32's embedding width; the sweep's W_MEMORY_MIB (its chunk, small beside C d)


class TinyClip(nn.Module):
    """The dry run's stand-in for open_clip's CLIP: two small towers, a learnable logit scale, open_clip's
    output dict (normalised features, s = exp(logit_scale))."""

    def __init__(self, image: int, vocab: int, width: int = 32):
        super().__init__()
        self.visual = nn.Sequential(nn.Flatten(), nn.Linear(3 * image * image, width), nn.GELU(), nn.Linear(width, 16))
        self.token_embedding = nn.Embedding(vocab, width)
        self.text = nn.Sequential(nn.GELU(), nn.Linear(width, 16))
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))

    def forward(self, image, text):
        z_x = F.normalize(self.visual(image), dim=-1)
        z_y = F.normalize(self.text(self.token_embedding(text).mean(1)), dim=-1)
        return {"image_features": z_x, "text_features": z_y, "logit_scale": self.logit_scale.exp()}


def make_model(dry_run: bool, device: torch.device) -> tuple[nn.Module, str]:
    if dry_run:
        return TinyClip(16, 100).to(device), "tiny two-tower stand-in (dry run)"
    import open_clip

    return open_clip.create_model("ViT-B-32", pretrained=None, output_dict=True).to(
        device
    ), f"open_clip {open_clip.__version__} ViT-B-32"


def batch(n: int, dry_run: bool, device: torch.device, seed: int = 0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    image, vocab = (16, 100) if dry_run else (IMAGE, VOCAB)
    x = torch.randn(n, 3, image, image, generator=g).to(device)
    y = torch.randint(0, vocab, (n, CONTEXT if not dry_run else 8), generator=g).to(device)
    return x, y


def recipe_step(model: nn.Module, optimizer, x, y, autocast) -> float:
    """open_clip's recipe at P = 1: one forward, the N x N logits, the symmetric cross entropy, backward, step."""
    optimizer.zero_grad(set_to_none=True)
    with autocast():
        out = model(x, y)
        logits = out["logit_scale"] * out["image_features"] @ out["text_features"].T
        labels = torch.arange(len(x), device=x.device)
        loss = (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2
    loss.backward()
    optimizer.step()
    return loss.item()


def distlab_step(model: nn.Module, optimizer, x, y, autocast, micro: int) -> float:
    config = {"GLOBAL_BATCH_SIZE": len(x), "MICRO_BATCH_SIZE": micro, "MATMUL_PRECISION": "bf16"}
    with autocast():
        return distributed_train_step(model, optimizer, x, y, config)


def timed(device: torch.device, call) -> dict:
    """One call's wall time and peak memory above what was allocated before it (CUDA), or an OOM."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    start = time.perf_counter()
    try:
        loss = call()
    except torch.OutOfMemoryError:
        return {"oom": True}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    out = {"seconds": time.perf_counter() - start, "loss": loss, "oom": False}
    if device.type == "cuda":
        out["peak_gib"] = (torch.cuda.max_memory_allocated(device) - base) / 2**30
    return out


class Bench:
    """The two methods side by side on one device: the recipe's model and a copy of it under DDP, each with its
    AdamW; `run` times one step of either on a fresh random batch."""

    RECIPE, DISTLAB = "open_clip recipe", "distlab step"

    def __init__(self, device: torch.device, dry: bool):
        self.device, self.dry, self.micro = device, dry, 256
        torch.manual_seed(0)
        base, self.name = make_model(dry, device)
        self.models = {self.RECIPE: base, self.DISTLAB: DDP(copy.deepcopy(base))}
        self.optimizers = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in self.models.items()}
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.autocast = lambda: torch.autocast(device.type, dtype=dtype, enabled=device.type == "cuda")

    def run(self, method: str, n: int, seed: int = 0) -> dict:
        x, y = batch(n, self.dry, self.device, seed)
        model, opt = self.models[method], self.optimizers[method]
        if method == self.RECIPE:
            return timed(self.device, lambda: recipe_step(model, opt, x, y, self.autocast))
        return timed(self.device, lambda: distlab_step(model, opt, x, y, self.autocast, min(self.micro, n)))


def largest_batch(bench: Bench, memory_gib: float | None, reserve_gib: float) -> int:
    """The recipe's N_max: its peak at two small batches, a straight line to the device's memory (minus a
    reserve), a multiple of 256, halved until a step runs."""
    device, n_max = bench.device, 256
    if device.type == "cuda":
        small = [256, 512]
        peaks = [bench.run(bench.RECIPE, n).get("peak_gib") for n in small]
        limit = (memory_gib or torch.cuda.get_device_properties(device).total_memory / 2**30) - 4
        per = (peaks[1] - peaks[0]) / (small[1] - small[0])
        n_max = int((limit - reserve_gib - peaks[0] + per * small[0]) / per) // 256 * 256
    while n_max >= 256 and bench.run(bench.RECIPE, n_max).get("oom", True):
        n_max //= 2
        torch.cuda.empty_cache() if device.type == "cuda" else None
    return n_max


def batches(bench: Bench, n_max: int, micro: int | None) -> list[dict]:
    """Both methods at N_max, 4 N_max and 16 N_max (the recipe skipped once it ran out of memory), each after a
    warm-up step that compiles, allocates and tunes."""
    rows = []
    for factor in (1, 4, 16):
        n = n_max * factor
        bench.micro = micro or (n_max if factor == 1 else max(1, n_max // 2))
        for method in bench.models:
            if factor > 1 and method == bench.RECIPE and rows and rows[-1].get("oom"):
                continue
            if factor == 1 or method == bench.DISTLAB:
                bench.run(method, n, seed=1)
            rows.append({"n": n, "factor": factor, "method": method, "micro": bench.micro, **bench.run(method, n, 2)})
            print(json.dumps(rows[-1]), flush=True)
            torch.cuda.empty_cache() if bench.device.type == "cuda" else None
    return rows


def ring_sweep(device: torch.device, n: int, d: int, worlds=(1, 2, 4, 8)) -> list[dict]:
    """Rank 0's share of the InfoNCE ring at fixed N for each P (the module docstring's step 4): its peak memory
    counted, the allocator's on CUDA, and the blocks in flight by formula; KERNELS "auto" at bf16."""
    gen = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    z_x, z_y = (F.normalize(torch.randn(n, d, generator=gen), dim=1).to(device, dtype) for _ in range(2))
    rows = []
    for world in worlds:
        keys = {"GLOBAL_BATCH_SIZE": n, "MICRO_BATCH_SIZE": n // world, "EXCHANGE": "ring"}
        cfg = parse_config(keys | {"MATMUL_PRECISION": "bf16", "W_MEMORY_MIB": SWEEP_MIB}, world, 0)
        ops = tile_ops(cfg.kernels, cfg.precision, 1024, device, dtype, d, cfg.w_budget)
        with PeakMemory(device) as peak:
            one_rank(cfg, z_x, z_y, "infonce", ops)
        c = n // world
        in_flight = c * d * (z_x.element_size() + 4)  # a visiting block and the accumulator of G_y (float32)
        rows.append({"world": world, "c": c, "kernels": ops.name, "peak_bytes": peak.peak_bytes + in_flight})
        rows[-1] |= {"allocator_peak_bytes": peak.allocator_peak_bytes, "in_flight_bytes": in_flight}
        print(json.dumps(rows[-1]), flush=True)
    return rows


def sweep_markdown(rows: list[dict], n: int, d: int) -> list[str]:
    """The sweep's table: memory per rank at each P, and P times it against P = 1's (1.00: exactly 1/P)."""
    lines = ["", f"## The ring at fixed N = {n}, d = {d}: memory per rank against P (one card, rank 0's share)", ""]
    lines += [f"W_MEMORY_MIB = {SWEEP_MIB}; peak = counted tensor storage + the blocks in flight (formula)", ""]
    lines += ["| P | C | KERNELS | peak MiB per rank | P x peak / peak at P = 1 | allocator peak MiB |"]
    lines += ["|---:|---:|---|---:|---:|---:|"]
    for r in rows:
        allocator = f"{r['allocator_peak_bytes'] / 2**20:.1f}" if r["allocator_peak_bytes"] is not None else ""
        scaled = r["world"] * r["peak_bytes"] / rows[0]["peak_bytes"]
        lines.append(
            f"| {r['world']} | {r['c']} | {r['kernels']} | {r['peak_bytes'] / 2**20:.1f} | {scaled:.2f} | {allocator} |"
        )
    return lines


def markdown(report: dict, args) -> str:
    """The table: seconds a step, pairs a second, peak memory, and the ratio to the recipe at N_max."""
    first, rows = report["first"], report["rows"]
    lines = [
        f"# A CLIP batch one GPU could not hold: {report['model']} on {report['card']}",
        "",
        f"N_max = {report['n_max']} (open_clip's recipe), distlab's B = {args.micro_batch or 'N_max, then N_max / 2'}; "
        f"first losses (N = 256, same weights) {first[Bench.RECIPE]:.4f} (recipe) and {first[Bench.DISTLAB]:.4f} "
        f"(distlab); memory {f'capped at {args.memory_gib} GiB' if args.memory_gib else 'the whole card'}",
        "",
        "| N | method | seconds a step | pairs / s | peak GiB | time per pair x recipe's at N_max |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    ref = next((r for r in rows if r["factor"] == 1 and r["method"] == Bench.RECIPE), {})
    for r in rows:
        if r["oom"]:
            lines.append(f"| {r['n']} | {r['method']} | out of memory | | | |")
            continue
        per_pair = (r["seconds"] / r["n"]) / (ref["seconds"] / ref["n"]) if ref.get("seconds") else None
        ratio = f"{per_pair:.2f}" if per_pair is not None else ""
        peak = f"{r['peak_gib']:.1f}" if "peak_gib" in r else ""
        lines.append(
            f"| {r['n']} | {r['method']} | {r['seconds']:.3f} | {r['n'] / r['seconds']:.0f} | {peak} | {ratio} |"
        )
    if report.get("sweep"):
        lines += sweep_markdown(report["sweep"], report["sweep_n"], report["sweep_d"])
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--cpu-dry-run", action="store_true", help="a tiny stand-in model on the CPU")
    parser.add_argument("--memory-gib", type=float, help="cap the device's memory (set_per_process_memory_fraction)")
    parser.add_argument("--reserve-gib", type=float, default=4.0, help="left free when extrapolating N_max")
    parser.add_argument("--micro-batch", type=int, help="distlab's B (default: N_max at N_max, N_max / 2 above)")
    parser.add_argument("--n-max", type=int, help="skip the search: the recipe's largest batch")
    args = parser.parse_args()
    if args.micro_batch is not None and args.micro_batch < 1:
        raise ValueError(f"--micro-batch must be >= 1, got {args.micro_batch}")
    with distributed("cpu" if args.cpu_dry_run else "auto") as rt:
        device = rt.device
        if device.type == "cuda" and args.memory_gib:
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, args.memory_gib * 2**30 / total), device)
        bench = Bench(device, args.cpu_dry_run)
        first = {method: bench.run(method, 256)["loss"] for method in bench.models}  # same weights, same batch
        print(f"first step's loss at N = 256: {first}", flush=True)
        n_max = args.n_max or largest_batch(bench, args.memory_gib, args.reserve_gib)
        card = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
        report = {"card": card, "model": bench.name, "n_max": n_max, "micro": args.micro_batch, "first": first}
        report["rows"] = batches(bench, n_max, args.micro_batch)
        report["sweep_n"], report["sweep_d"] = (64, 16) if args.cpu_dry_run else (16 * n_max, EMBED)
        report["sweep"] = ring_sweep(device, report["sweep_n"], report["sweep_d"])
        if rt.rank == 0:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "clip_batch.json").write_text(json.dumps(report, indent=1))
            (args.out / "clip_batch.md").write_text(markdown(report, args))
            print(markdown(report, args))
    return 0


if __name__ == "__main__":
    run_main(main)
