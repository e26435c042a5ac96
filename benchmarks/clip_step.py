"""A whole CLIP training step at large N: open_clip's recipes against the streamed step, the InfoNCE
and sigmoid loss machineries against open_clip's and against the matmul floors, gather against ring:
per-rank time and peak memory.

    torchrun --standalone --nproc-per-node 2 benchmarks/clip_step.py      # P = 2, N = 1024 ... 16384
    for p in 2 3 4; do torchrun --standalone --nproc-per-node $p benchmarks/clip_step.py --fixed-c 2048; done
    python benchmarks/clip_step.py --report                                # tables and plots from the JSON

Parts (d = 256, float32, T = 512):
  step     a small two-tower encoder (64 -> 256 -> d per tower), AdamW. open_clip recipe: one forward;
           both towers' C x d embeddings gathered with the sum-backward gather (lesson 23), the C x N
           local loss, backward, step: open_clip's ClipLoss(local_loss=True, gather_with_grad=True)
           under DDP. streamed, B = C: `distributed_backward` with one forward, the graph kept;
           streamed, B = C/8: eight micro-batches, each a no-grad forward then a recompute. The 6 C N d
           floor is timed beside them, interleaved.
  loss     the InfoNCE loss machinery (C x d embeddings in, dL/dZ out, no encoder): open_clip's recipe,
           the streamed step gathered (B = C, C/8) and in a ring, and the 6 and 4 C N d matmul floors
           (`clip_step_losses` says what each runs).
  sigmoid  the sigmoid loss machinery: open_clip's SigLipLoss recipe (bidir, gather) against the
           streamed sigmoid loss (gather, ring).
--fixed-c C runs the loss and sigmoid parts once at N = C P, into clip_step_c{C}_p{P}: run at several P,
it gives peak memory per rank against P at a fixed C (`--report` tables them together). Every run also
counts the launches and bytes per step of both tile paths (torch tiles, Triton kernels) at its smallest and
largest N on the meta device (`clip_step_launches.py`; run alone it counts the GPU-sized step).

Memory: the peak of tensor storage a call allocated on a rank (`distlab.proof.memory.PeakMemory`; also
`torch.cuda.max_memory_allocated` on GPUs), the worst rank, in its own run (watching every op slows
small ones down). Time: the wall clock of the slowest rank, median of --repeats, the methods
interleaved at each N so that load on a shared machine hits them alike. Before timing, each part's
methods are checked to give the same dL/dZ (or step gradients) at the smallest N: the benchmark
compares exact methods only. Writes benchmarks/results/clip_step_p{P}.{json,md,png}.
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

from distlab.processes.console import print0
from distlab.processes.flags import positive_int
from distlab.processes.runtime import distributed, run_main
from distlab.proof.cli import add_runtime_args
from distlab.proof.models import TwoTower
from distributed_clip import distributed_backward

sys.path.insert(0, str(Path(__file__).parent))
from clip_step_launches import count_launches, launch_markdown  # noqa: E402
from clip_step_losses import (
    B_C8,
    B_EQ_C,
    BASE,
    FLOOR,
    FLOORS,
    INFONCE,
    OPEN_CLIP,
    SIGMOIDS,
    TAU,  # noqa: E402
    config,
    floor_6,
    micro_of,
    open_clip_loss,
)
from clip_step_report import write_memory_report, write_report  # noqa: E402
from measure import local_embeddings, measure_interleaved  # noqa: E402

RESULTS = Path(__file__).parent / "results"
STEP_METHODS = (OPEN_CLIP, B_EQ_C, B_C8)
PARTS = {"loss": INFONCE, "sigmoid": SIGMOIDS}  # the loss machineries, each part's methods


# ---------------------------------------------------------------------------------------------
# A whole training step
# ---------------------------------------------------------------------------------------------


def backward_open_clip(model, x, y, rt):
    """open_clip's ClipLoss(local_loss=True, gather_with_grad=True) and loss.backward() under DDP."""
    loss = open_clip_loss(*model(x, y), rt)
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


def _max_rel(got: dict, base: str) -> float:
    return max(((g - got[base]).abs().max() / got[base].abs().max()).item() for g in got.values())


def check_agreement(args, rt) -> dict:
    """At the smallest N, each part's methods (the floors aside) give the same step gradients or dL/dZ:
    the benchmark compares exact methods. Returns each part's largest relative difference."""
    n, out = args.sizes[0], {}
    if "step" in args.parts:
        x, y = local_batch(n, rt)
        grads = {}
        for method in STEP_METHODS:
            model = make_model(args, rt)
            backward(method, model, x, y, rt, args.stream_chunk)
            grads[method] = torch.cat([p.grad.flatten() for p in model.parameters()])
        out["step"] = _max_rel(grads, OPEN_CLIP)
    z = local_embeddings(n, args.dim, rt)
    for part in ("loss", "sigmoid"):
        if part in args.parts:
            got = {m: torch.cat(fn(*z, rt, args.stream_chunk, m)) for m, fn in PARTS[part].items() if m not in FLOORS}
            out[part] = _max_rel(got, BASE[part])
    return out


def calls_at(part: str, n: int, args, rt) -> dict:
    """method -> a zero-argument call that runs one step (or one loss machinery) at this N."""
    z = local_embeddings(n, args.dim, rt)
    if part in PARTS:
        return {m: (lambda m=m, fn=fn: fn(*z, rt, args.stream_chunk, m)) for m, fn in PARTS[part].items()}
    x, y = local_batch(n, rt)
    calls = {}
    for m in STEP_METHODS:
        model = make_model(args, rt)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        calls[m] = lambda m=m, model=model, opt=optimizer: train_step(m, model, opt, x, y, rt, args.stream_chunk)
    calls[FLOOR] = lambda: floor_6(*z, rt, args.stream_chunk, FLOOR)  # the yardstick, interleaved with the steps
    return calls


def run_part(part: str, args, rt) -> dict:
    results = {}
    for n in args.sizes:
        calls = calls_at(part, n, args, rt)
        for fn in calls.values():
            fn()  # warm-up: DDP's first iteration, AdamW's state, lazy allocations
        for m, got in measure_interleaved(calls, rt, args.repeats).items():
            results.setdefault(m, []).append({"n": n, **got})
            print0(
                f"{part:7s} N={n:6d} {m:22s} peak {got['peak_bytes'] / 2**20:8.1f} MiB  time {got['time_s']:7.3f} s",
                highlight=False,
            )
        del calls
    return results


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sizes", type=positive_int, nargs="+", default=[1024, 2048, 4096, 8192, 16384], help="global batches N"
    )
    parser.add_argument(
        "--fixed-c",
        type=positive_int,
        metavar="C",
        help="run the loss and sigmoid parts once at N = C P (memory against P at a fixed C)",
    )
    parser.add_argument("--dim", type=positive_int, default=256, help="d, the embedding width")
    parser.add_argument("--stream-chunk", type=positive_int, default=512, help="T: tiles are at most T x T")
    parser.add_argument("--repeats", type=positive_int, default=3, help="timed runs per method and N")
    parser.add_argument("--parts", nargs="+", choices=("step", *PARTS), default=["step", *PARTS])
    parser.add_argument("--out", help="output path without suffix (default: results/clip_step_p{P})")
    parser.add_argument("--report", action="store_true", help="only rewrite the tables and plots from results/")
    return add_runtime_args(parser).parse_args()


def device_name(rt) -> str:
    if rt.device.type == "cuda":
        return torch.cuda.get_device_name(rt.device)
    return (
        f"CPU {platform.machine()} ({torch.backends.cpu.get_cpu_capability()}), "
        f"{torch.get_num_threads()} thread(s) per rank"
    )


def launches_per_step(args, rt) -> list[dict]:
    """Launches and bytes per step of both tile paths at the smallest and largest N, counted on the meta
    device (no timing), printed."""
    sizes = sorted({args.sizes[0], args.sizes[-1]})
    launches = count_launches(sizes, rt.world_size, args.dim, args.stream_chunk)
    print0(launch_markdown(launches, rt.world_size, args.dim, args.stream_chunk), highlight=False)
    return launches


def write_reports() -> str:
    """Every report from the JSON in results/: the P = 2 tables and plot, and memory against P."""
    text = write_report(RESULTS / "clip_step_p2.json")
    fixed = sorted(RESULTS.glob("clip_step_c*_p*.json"))
    return text + (write_memory_report(fixed, RESULTS / "clip_step_memory_vs_p") if fixed else "")


def main() -> int:
    args = parse_args()
    if args.report:
        print(write_reports())
        return 0
    with distributed(args.device) as rt:
        if args.fixed_c:
            args.sizes, args.parts = [args.fixed_c * rt.world_size], [p for p in args.parts if p != "step"]
        if any(n % (8 * rt.world_size) for n in args.sizes):
            raise ValueError(f"--sizes: every N must be divisible by 8 P = {8 * rt.world_size} (B = C/8)")
        meta = {
            "world": rt.world_size,
            "dim": args.dim,
            "stream_chunk": args.stream_chunk,
            "dtype": "float32",
            "tau": TAU,
            "sizes": args.sizes,
            "repeats": args.repeats,
            "device": device_name(rt),
            "torch": torch.__version__,
            "backend": rt.backend,
            "command": f"torchrun --standalone --nproc-per-node {rt.world_size} benchmarks/clip_step.py "
            + " ".join(sys.argv[1:]),
        }
        agreement = check_agreement(args, rt)
        print0(
            f"methods agree at N={args.sizes[0]}: max relative difference of dL/dZ (or step gradients) "
            + ", ".join(f"{part} {rel:.1e}" for part, rel in agreement.items())
        )
        if max(agreement.values()) > 1e-4:
            raise RuntimeError(f"methods disagree ({agreement}): the benchmark would compare different things")
        meta["load_average_before"] = os.getloadavg()[0]  # the machine may be shared: say how busy it was
        results = {part: run_part(part, args, rt) for part in args.parts}
        meta["load_average_after"] = os.getloadavg()[0]
        if rt.is_first:
            launches = launches_per_step(args, rt)
            name = f"clip_step_c{args.fixed_c}_p{rt.world_size}" if args.fixed_c else f"clip_step_p{rt.world_size}"
            out = Path(args.out) if args.out else RESULTS / name
            out.parent.mkdir(parents=True, exist_ok=True)
            out.with_suffix(".json").write_text(
                json.dumps(
                    {"meta": meta, "agreement_max_rel": agreement, "results": results, "launches": launches}, indent=1
                )
            )
            if args.fixed_c:
                print0(
                    f"wrote {out}.json; after the runs at every P, `python benchmarks/clip_step.py --report` "
                    "tables memory against P",
                    highlight=False,
                )
            else:
                text = write_report(out.with_suffix(".json"))
                print0(
                    f"wrote {out}.{{json,md,png}}\n" + text[text.index("**Targets**") :],
                    highlight=False,
                    soft_wrap=True,
                )
    return 0


if __name__ == "__main__":
    run_main(main)
