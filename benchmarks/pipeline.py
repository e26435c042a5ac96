"""Step time of naive model parallelism, GPipe and 1F1B against the number of micro-batches M.

    # one run per pipeline depth P (gloo on CPU; nccl with one GPU per rank, unchanged):
    for P in 1 2 4; do OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node $P benchmarks/pipeline.py; done
    python benchmarks/pipeline.py --report      # table (Markdown) and plot (PNG) from every P's JSON

Each configuration runs `--warmup` untimed steps; then `--repeats` rounds time one step of every
configuration in turn (round-robin, so a burst of load from other users of a shared machine hits
all configurations alike). A step is timed from a barrier to a barrier (and a CUDA synchronize on
GPUs), so it covers the slowest rank. We report the median and the spread (min..max). P = 1 is the
unsplit model in one process, the baseline the ideal pipeline is measured against:

    ideal(P, M) = t_1 / P * (M + P - 1) / M     (perfect split, no transfer cost, bubble only)

which assumes one core (or GPU) per rank: with more ranks than cores (4 ranks on a 2-core laptop)
no schedule can beat t_1 / cores, and the report says so.

The model is `layered_mlp` (Linear + Tanh layers) in float32, the loss the batch-mean MSE; only
forward and backward are timed (no optimizer step: it is the same for every schedule).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from distlab.model_split.runner import PipelineStep
from distlab.model_split.training import PipelineConfig
from distlab.processes.console import print0
from distlab.processes.flags import add_global_batch, positive_int
from distlab.processes.runtime import distributed, run_main
from distlab.proof.cli import add_runtime_args

RESULTS = Path(__file__).parent / "results"
MICROBATCHES = (1, 2, 4, 8, 16, 32)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--report", action="store_true", help="merge the JSON files into a table and a plot")
    parser.add_argument("--layers", type=positive_int, default=16)
    parser.add_argument("--width", type=positive_int, default=512)
    add_global_batch(parser, 512)
    parser.add_argument("--micro-batches", type=positive_int, nargs="+", default=list(MICROBATCHES), help="values of M")
    parser.add_argument("--warmup", type=positive_int, default=2)
    parser.add_argument("--repeats", type=positive_int, default=15)
    parser.add_argument("--out", type=Path, default=RESULTS)
    return add_runtime_args(parser).parse_args()


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        model = platform.processor() or "unknown CPU"
    return f"{model}, {os.cpu_count()} cores"


def time_step(rt, run) -> float:
    """Seconds for one forward + backward step, from a barrier to a barrier."""

    def sync():
        if rt.device.type == "cuda":
            torch.cuda.synchronize(rt.device)
        dist.barrier()

    for stage in run.stages:
        for param in stage.module.parameters():
            param.grad = None
    sync()
    start = time.perf_counter()
    run(0)
    sync()
    # Every rank measured the same barrier-to-barrier window; rank 0's number stands for the step.
    return time.perf_counter() - start


def measure(args) -> int:
    widths = (args.width,) * (args.layers + 1)
    with distributed(args.device) as rt:
        p = rt.world_size
        configs = [("naive", 1)] if p > 1 else [("unsplit", 1)]
        configs += [(name, m) for name in ("gpipe", "1f1b") for m in args.micro_batches if p > 1]
        load_before = os.getloadavg()[0]
        base = PipelineConfig(widths=widths, global_batch=args.global_batch, seed=args.seed, dtype=torch.float32)
        runs = [
            PipelineStep(rt, base.replace(schedule="gpipe" if name in ("unsplit", "naive") else name, micro_batches=m))
            for name, m in configs
        ]
        for run in runs:
            for _ in range(args.warmup):
                time_step(rt, run)
        # Round-robin: one step of every configuration per round, so that a burst of load from
        # other users of the machine slows all of them alike instead of one configuration's run.
        times: list[list[float]] = [[] for _ in configs]
        for _ in range(args.repeats):
            for k, run in enumerate(runs):
                times[k].append(time_step(rt, run))
        rows = []
        for (name, m), ts in zip(configs, times):
            rows.append(
                {
                    "schedule": name,
                    "M": m,
                    "median_s": statistics.median(ts),
                    "min_s": min(ts),
                    "max_s": max(ts),
                    "times_s": ts,
                }
            )
            print0(
                f"P={p} {name:>7} M={m:>2}: median {rows[-1]['median_s'] * 1e3:8.1f} ms "
                f"(min {min(ts) * 1e3:.1f}, max {max(ts) * 1e3:.1f})"
            )
        if rt.is_first:
            args.out.mkdir(parents=True, exist_ok=True)
            meta = {
                "P": p,
                "backend": rt.backend,
                "device": device_name(rt.device),
                "cores": os.cpu_count(),
                "torch": torch.__version__,
                "layers": args.layers,
                "width": args.width,
                "global_batch": args.global_batch,
                "dtype": "float32",
                "warmup": args.warmup,
                "repeats": args.repeats,
                "load_average_before": load_before,
                "load_average_after": os.getloadavg()[0],
                "command": f"torchrun --standalone --nproc-per-node {p} benchmarks/pipeline.py",
            }
            path = args.out / f"pipeline_{rt.device.type}_P{p}.json"
            path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
            print0(f"wrote {path}")
    return 0


def report(args) -> int:
    """Markdown table and PNG plot from every pipeline_<device>_P<P>.json in --out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for device in ("cpu", "cuda"):
        files = sorted(args.out.glob(f"pipeline_{device}_P*.json"))
        if not files:
            continue
        results = {r["meta"]["P"]: r for r in map(lambda f: json.loads(f.read_text()), files)}
        base = results.get(1, {}).get("rows", [{}])[0].get("median_s")
        meta = next(iter(results.values()))["meta"]
        cores = meta.get("cores") if device == "cpu" else None
        lines = [
            f"Step time (forward + backward), median of {meta['repeats']} round-robin steps after "
            f"{meta['warmup']} warm-up, on {meta['device']} ({meta['backend']}), torch {meta['torch']}; "
            f"{meta['layers']} layers of width {meta['width']}, "
            f"batch {meta.get('global_batch', meta.get('batch_size'))}, float32. "
            "Load average (1 min) before/after each run: "
            + ", ".join(
                f"P={p}: {r['meta']['load_average_before']:.1f}/{r['meta']['load_average_after']:.1f}"
                for p, r in sorted(results.items())
            )
            + ".",
            "",
            "`ideal` = t_1 / P * (M + P - 1) / M from the unsplit step t_1: one core per rank, no "
            "transfer cost, only the bubble."
            + (
                f" Rows with P > {cores} cores cannot reach it (at best t_1 / {cores})."
                if cores and max(results) > cores
                else ""
            ),
            "",
            "| P | schedule | M | median ms | min..max ms | ideal ms (bubble only) |",
            "|---:|---|---:|---:|---:|---:|",
        ]
        fig, axes = plt.subplots(1, max(1, len([p for p in results if p > 1])), figsize=(11, 4), squeeze=False)
        for p, res in sorted(results.items()):
            for row in res["rows"]:
                ideal = base / p * (row["M"] + p - 1) / row["M"] if base else float("nan")
                lines.append(
                    f"| {p} | {row['schedule']} | {row['M']} | {row['median_s'] * 1e3:.1f} | "
                    f"{row['min_s'] * 1e3:.1f}..{row['max_s'] * 1e3:.1f} | "
                    f"{ideal * 1e3:.1f} |"
                    if p > 1
                    else f"| 1 | unsplit | 1 | {row['median_s'] * 1e3:.1f} | "
                    f"{row['min_s'] * 1e3:.1f}..{row['max_s'] * 1e3:.1f} | |"
                )
        for ax, p in zip(axes[0], sorted(p for p in results if p > 1)):
            rows = results[p]["rows"]
            for name, style in (("gpipe", "o-"), ("1f1b", "s--")):
                sel = [r for r in rows if r["schedule"] == name]
                ms = [r["M"] for r in sel]
                ax.errorbar(
                    ms,
                    [r["median_s"] * 1e3 for r in sel],
                    yerr=[
                        [(r["median_s"] - r["min_s"]) * 1e3 for r in sel],
                        [(r["max_s"] - r["median_s"]) * 1e3 for r in sel],
                    ],
                    fmt=style,
                    capsize=3,
                    label={"gpipe": "GPipe", "1f1b": "1F1B"}[name],
                )
            naive = next(r for r in rows if r["schedule"] == "naive")
            ax.axhline(naive["median_s"] * 1e3, color="gray", ls=":", label="naive (M=1)")
            if base:
                ms = sorted({r["M"] for r in rows})
                ax.plot(
                    ms,
                    [base / p * (m + p - 1) / m * 1e3 for m in ms],
                    color="green",
                    alpha=0.6,
                    label="ideal: t1/P (M+P-1)/M",
                )
                ax.axhline(base * 1e3, color="black", lw=0.8, label="unsplit, one process")
                if cores and p > cores:
                    ax.axhline(
                        base / cores * 1e3,
                        color="green",
                        ls="--",
                        lw=0.8,
                        label=f"t1/{cores}: best possible on {cores} cores",
                    )
            ax.set_xscale("log", base=2)
            ax.set_xlabel("micro-batches M")
            ax.set_ylabel("ms per step")
            ax.set_title(f"P = {p}")
            ax.legend(fontsize=8)
        fig.suptitle(f"Pipeline step time on {meta['device']} ({meta['backend']})", fontsize=10)
        fig.tight_layout()
        png, md = args.out / f"pipeline_{device}.png", args.out / f"pipeline_{device}.md"
        fig.savefig(png, dpi=120)
        md.write_text("\n".join(lines) + "\n")
        print(f"wrote {md} and {png}")
    return 0


def main() -> int:
    args = parse_args()
    return report(args) if args.report else measure(args)


if __name__ == "__main__":
    sys.exit(main()) if "--report" in sys.argv else run_main(main)
