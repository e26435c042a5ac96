"""The fused Triton kernels on one CUDA device: exact first, then timed against open_clip's recipes and the
bf16 matmul floor, at one rank's shape of a large step. Made to run once, in under 3 minutes, on a lent GPU:

    python benchmarks/kernels_gpu.py OUT_DIR                         # one CUDA device (H100 / H200)
    TRITON_INTERPRET=1 python benchmarks/kernels_gpu.py OUT_DIR --cpu-dry-run   # the same code, tiny, on a CPU

(a) exact: at P = 1, N = 512, d = 128 (N = 64, d = 32 in the dry run), KERNELS "triton" (S and W in registers),
    "triton-mm" (W in memory, multiplied by cuBLAS: `kernels.coefficients`) and "triton-s" (S by cuBLAS, one
    memory-bound pass: `kernels.s_in_memory`) against the torch tiles
    and plain autograd on the whole batch in float64 (`clip_loss`, `sigmoid_loss`), for {InfoNCE, sigmoid} x
    {gather, ring}: float32 embeddings at MATMUL_PRECISION "float32" to 1e-5 (relative, G_x and G_y); bf16
    embeddings at "bf16" within 1.25x of what plain autograd under bf16 autocast achieves against the same
    truth (the kernels round the coefficient tile to bf16 for their second product, as autocast rounds the
    logits; on this CPU 2.9e-3 / 3.3e-3 against autocast's 4.2e-3 / 3.4e-3, InfoNCE / sigmoid).
(b) time and memory at one rank's shape of N = 65,536, P = 8 (C = 8,192), d = 1,024, bf16 embeddings
    (`rank_work.one_rank`: rank 0's tile work, the exchange left out): the InfoNCE machinery by the kernels
    (gather, ring; "bf16", and "float32" for the default precision; "triton-mm" beside them), by the torch
    tiles (float32, the default T), open_clip's ClipLoss(local_loss=True, gather_with_grad=True) under bf16
    autocast (`local_clip_loss`, C x N logits, autograd), the 6 C N d bf16 matmul floor (cuBLAS, column chunks
    of 8,192); the sigmoid by the kernels against open_clip's SigLipLoss (`siglip_recipe.block_loss` over the P
    blocks of C x C, autograd); a few block sizes for the kernels; and at P = 1, N = 65,536 the kernels (both
    Triton paths) against the 6 N^2 d floor.
(c) launches and bytes per step of the three paths (the gathered InfoNCE), counted on the meta device at N = 4,096
    and 65,536. --budget S (150 on a GPU): (b) skips what is left once S seconds have passed, and says so.

Each row: the median of --repeats after a warm-up (which compiles), torch.cuda.synchronize around each,
torch.cuda.max_memory_allocated above what was allocated before. A part that raises (an OOM, a compile error)
is recorded with its error and skipped. Writes OUT_DIR/kernels_gpu.json and OUT_DIR/kernels_gpu.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

from distlab.contrastive.losses import clip_loss, local_clip_loss, sigmoid_loss
from distlab.contrastive.siglip_recipe import block_loss
from distlab.streamed.chunk_size import chunk_for
from distlab.streamed.config import parse_config
from distlab.streamed.kernel_choice import TorchTiles, TritonTiles, tile_ops
from distlab.streamed.kernels.launch import Blocks
from distlab.streamed.rank_work import BETA, S_SIGMOID, TAU, count_rank, one_rank

SHAPES = {
    "gpu": dict(check=(512, 128), n=65536, world=8, d=1024),
    "cpu": dict(check=(48, 24), n=128, world=8, d=24),  # the dry run: every path once, in the interpreter
}
SWEEP = [Blocks(128, 128, 64, 8, 3), Blocks(128, 64, 64, 8, 3)]  # beside the default 128 x 256 x 64, 8 warps, 3 stages
# --sweep: launch configurations around each loss's default (m x n x d, warps, stages[, column splits or rows of W
# per chunk]), for the fused kernels and for W in memory ("triton-mm"), each checked exact at the check shape
# before it is timed.
GRID = {
    ("infonce", "triton"): [
        Blocks(128, 128, 64, 8, 4),
        Blocks(128, 256, 64, 8, 4),
        Blocks(128, 256, 32, 8, 4),
        Blocks(256, 128, 64, 8, 3),
        Blocks(128, 128, 128, 8, 2),
        Blocks(128, 128, 64, 4, 3),
        Blocks(64, 128, 64, 4, 3),
        Blocks(128, 256, 64, 8, 3, splits=2),
        Blocks(128, 256, 64, 8, 3, splits=10),
    ],
    ("sigmoid", "triton"): [
        Blocks(128, 64, 32, 8, 4),
        Blocks(128, 128, 64, 8, 4),
        Blocks(128, 256, 64, 8, 3),
        Blocks(128, 64, 64, 8, 3),
        Blocks(64, 128, 32, 4, 4),
        Blocks(128, 64, 32, 8, 4, splits=10),
    ],
    ("infonce", "triton-mm"): [
        Blocks(128, 128, 64, 8, 4),
        Blocks(128, 256, 64, 8, 3),
        Blocks(128, 128, 64, 4, 4),
        Blocks(128, 128, 64, 8, 3, w_rows=4096),
        Blocks(128, 128, 64, 8, 3, w_rows=1024),
    ],
    ("sigmoid", "triton-mm"): [
        Blocks(128, 128, 64, 8, 4),
        Blocks(128, 128, 64, 8, 3, w_rows=4096),
    ],
}

KERNEL_PATHS = ("triton", "triton-mm", "triton-s")  # fused, W in memory, S in memory (`kernels.path_model`)


def config(n, world, exchange="gather", kernels="triton", precision="bf16"):
    keys = {"GLOBAL_BATCH_SIZE": n, "MICRO_BATCH_SIZE": n // world, "TAU": TAU, "EXCHANGE": exchange}
    return parse_config(keys | {"KERNELS": kernels, "MATMUL_PRECISION": precision}, world, 0)


def embeddings(n, d, device, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    z_x = F.normalize(torch.randn(n, d, generator=gen), dim=1)
    z_y = F.normalize(z_x + torch.randn(n, d, generator=gen), dim=1)
    return z_x.to(device, dtype), z_y.to(device, dtype)


def rel(got, truth) -> float:
    return ((got.double() - truth.double()).norm() / truth.double().norm()).item()


def truth(z_x, z_y, loss, autocast=False):
    """dL/dZ_x, dL/dZ_y of the whole batch by plain autograd: float64, or the embeddings' dtype under autocast."""
    zx, zy = (z.clone().requires_grad_() if autocast else z.double().requires_grad_() for z in (z_x, z_y))
    with torch.autocast(z_x.device.type, dtype=torch.bfloat16, enabled=autocast):
        value = sigmoid_loss(zx, zy, S_SIGMOID, BETA) if loss == "sigmoid" else clip_loss(zx, zy, 1 / TAU)
    value.backward()
    return zx.grad, zy.grad


def check_exact(shape, device) -> list[dict]:
    """(a): the kernels against the torch tiles and plain autograd at P = 1."""
    (n, d), rows = shape["check"], []
    for dtype, precision in ((torch.float32, "float32"), (torch.bfloat16, "bf16")):
        z_x, z_y = embeddings(n, d, device, dtype)
        for loss in ("infonce", "sigmoid"):
            true_x, true_y = truth(z_x, z_y, loss)
            for exchange, kernels in ((e, k) for e in ("gather", "ring") for k in KERNEL_PATHS):
                cfg = config(n, 1, exchange, kernels, precision)
                got = one_rank(cfg, z_x, z_y, loss, tile_ops(kernels, precision, 64, device, torch.float32))
                tiles = one_rank(cfg, z_x, z_y, loss, TorchTiles(64, precision))
                err = max(rel(got[0], true_x), rel(got[1], true_y))
                row = dict(dtype=str(dtype), loss=loss, exchange=exchange, kernels=kernels, rel_truth=err)
                row["rel_torch_tiles"] = max(rel(got[0], tiles[0]), rel(got[1], tiles[1]))
                if dtype == torch.float32:
                    row["ok"] = err <= 1e-5 and row["rel_torch_tiles"] <= 1e-5
                else:
                    plain = truth(z_x, z_y, loss, autocast=True)
                    row["rel_autocast"] = max(rel(plain[0], true_x), rel(plain[1], true_y))
                    row["ok"] = err <= 1.25 * row["rel_autocast"]
                rows.append(row)
    return rows


def clip_recipe(z_x, z_y, world):
    """open_clip's ClipLoss(local_loss=True, gather_with_grad=True) on rank 0: C x N logits, bf16 autocast."""
    c = len(z_x) // world
    all_x, all_y = z_x.clone().requires_grad_(), z_y.clone().requires_grad_()
    with torch.autocast(z_x.device.type, dtype=torch.bfloat16):
        loss = local_clip_loss(all_x[:c], all_y[:c], all_x, all_y, 1 / TAU, 0)
    loss.backward()
    return all_x.grad[:c], all_y.grad[:c]


def siglip_recipe(z_x, z_y, world):
    """open_clip's SigLipLoss on rank 0: its C x C block with every rank's text block, autograd, bf16 autocast."""
    c = len(z_x) // world
    x, y = z_x[:c].clone().requires_grad_(), z_y.clone().requires_grad_()
    s, b = (torch.tensor(v, device=z_x.device, requires_grad=True) for v in (S_SIGMOID, BETA))
    with torch.autocast(z_x.device.type, dtype=torch.bfloat16):
        loss = sum(block_loss(x, blk, s, b, j != 0) for j, blk in enumerate(y.split(c)))
    loss.backward()
    return x.grad, y.grad[:c]


def floor(z_x, z_y, world, chunk=8192):
    """The 6 C N d multiply-adds of the gathered design as cuBLAS bf16 mm in column chunks (not a gradient)."""
    c = len(z_x) // world
    q_x, q_y, g_x, g_y = z_x[:c], z_y[:c], torch.zeros_like(z_x[:c]), torch.zeros_like(z_y[:c])
    for cols in torch.arange(len(z_x)).split(chunk):
        k_x, k_y = z_x[cols[0] : cols[-1] + 1], z_y[cols[0] : cols[-1] + 1]
        torch.mm(q_x, k_y.T), torch.mm(q_y, k_x.T)
        g_x.addmm_(torch.mm(q_x, k_y.T), k_y), g_y.addmm_(torch.mm(q_y, k_x.T), k_x)
    return g_x, g_y


def methods(shape, device) -> dict:
    """(b): name -> (setting, a zero-argument call) at one rank's shape (and at P = 1)."""
    n, world, d = shape["n"], shape["world"], shape["d"]
    z = embeddings(n, d, device, torch.bfloat16)

    def machinery(loss, exchange, ops, p=world):
        cfg = config(n, p, exchange, ops.name, ops.precision)
        return lambda: one_rank(cfg, *z, loss, ops)

    rank = f"one rank of P = {world}"
    in_memory = TritonTiles("bf16", w_in_memory=True)  # KERNELS "triton-mm"
    torch_t = chunk_for(config(n, world), device, torch.float32)  # the default T for this device
    calls = {
        "InfoNCE kernels, gather, bf16": (rank, machinery("infonce", "gather", TritonTiles("bf16"))),
        "InfoNCE kernels, ring, bf16": (rank, machinery("infonce", "ring", TritonTiles("bf16"))),
        "InfoNCE triton-mm, gather, bf16": (rank, machinery("infonce", "gather", in_memory)),
        "InfoNCE triton-mm, ring, bf16": (rank, machinery("infonce", "ring", in_memory)),
        "InfoNCE kernels, gather, float32": (rank, machinery("infonce", "gather", TritonTiles("float32"))),
        "InfoNCE torch tiles, float32": (rank, machinery("infonce", "gather", TorchTiles(torch_t, "float32"))),
        "open_clip ClipLoss, bf16 autocast": (rank, lambda: clip_recipe(*z, world)),
        "6 C N d floor, bf16 mm": (rank, lambda: floor(*z, world)),
        "sigmoid kernels, gather, bf16": (rank, machinery("sigmoid", "gather", TritonTiles("bf16"))),
        "sigmoid kernels, ring, bf16": (rank, machinery("sigmoid", "ring", TritonTiles("bf16"))),
        "sigmoid triton-mm, gather, bf16": (rank, machinery("sigmoid", "gather", in_memory)),
        "sigmoid triton-mm, ring, bf16": (rank, machinery("sigmoid", "ring", in_memory)),
        "open_clip SigLipLoss, bf16 autocast": (rank, lambda: siglip_recipe(*z, world)),
    }
    if device.type == "cuda":
        for b in SWEEP:
            name = f"InfoNCE kernels, gather, bf16, blocks {b.m}x{b.n}x{b.d} w{b.warps} s{b.stages}"
            calls[name] = (rank, machinery("infonce", "gather", TritonTiles("bf16", b)))
    calls["InfoNCE kernels, gather, bf16 (P = 1)"] = ("P = 1", machinery("infonce", "gather", TritonTiles("bf16"), 1))
    calls["InfoNCE triton-mm, gather, bf16 (P = 1)"] = ("P = 1", machinery("infonce", "gather", in_memory, 1))
    calls["6 N^2 d floor, bf16 mm (P = 1)"] = ("P = 1", lambda: floor(*z, 1))
    return calls


def sweep(shape, device, repeats, deadline) -> list[dict]:
    """--sweep: each configuration of GRID exact at the check shape (bf16 against float64 autograd, within 1.25x
    autocast's own error), then timed at one rank's shape; what the deadline leaves out is not run."""
    (n_check, d_check), rows = shape["check"], []
    small = embeddings(n_check, d_check, device, torch.bfloat16)
    z = embeddings(shape["n"], shape["d"], device, torch.bfloat16)
    for (loss, kernels), grid in GRID.items():
        true_x, true_y = truth(*small, loss)
        plain = truth(*small, loss, autocast=True)
        allowed = 1.25 * max(rel(plain[0], true_x), rel(plain[1], true_y))
        for b in grid:
            if time.perf_counter() > deadline:
                break
            ops = TritonTiles("bf16", b, w_in_memory=kernels == "triton-mm")
            got = one_rank(config(n_check, 1), *small, loss, ops)
            err = max(rel(got[0], true_x), rel(got[1], true_y))
            split = f"rows of W {b.w_rows or 'auto'}" if ops.w_in_memory else f"splits {b.splits or 'auto'}"
            row = dict(loss=loss, kernels=kernels, blocks=f"{b.m}x{b.n}x{b.d} w{b.warps} s{b.stages} {split}")
            row |= dict(rel_truth=err, ok=err <= allowed)
            cfg = config(shape["n"], shape["world"])
            row |= measure(lambda cfg=cfg, ops=ops, loss=loss: one_rank(cfg, *z, loss, ops), device, repeats)
            print(f"sweep {loss:8s} {kernels:9s} {row['blocks']:34s} {row['seconds']:.4f} s  rel {err:.1e}", flush=True)
            rows.append(row)
    return rows


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(call, device, repeats) -> dict:
    """Median seconds after a warm-up, and peak bytes above the start (CUDA)."""
    call()  # warm-up: compiles the kernels, fills the allocator
    sync(device)
    base = 0
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        sync(device)
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated(device) - base if device.type == "cuda" else None
    return dict(seconds=statistics.median(times), peak_bytes=peak)


def launch_counts(shape) -> list[dict]:
    """(c): launches and bytes per step of one rank, both paths, the InfoNCE gathered, counted on the meta device
    (every loss and exchange: `benchmarks/results/clip_step_launches.md`, the same on any device)."""
    rows = []
    for n in (4096, shape["n"]):
        paths = (("triton", "bf16", torch.bfloat16), ("triton-mm", "bf16", torch.bfloat16))
        for kernels, precision, dtype in paths + (("torch", "float32", torch.float32),):
            keys = {"GLOBAL_BATCH_SIZE": n, "MICRO_BATCH_SIZE": n // shape["world"], "STREAM_CHUNK_SIZE": 1024}
            keys |= {"TAU": TAU, "KERNELS": kernels, "MATMUL_PRECISION": precision}
            count = count_rank(parse_config(keys, shape["world"], 0), "infonce", shape["d"], dtype)
            rows.append(dict(n=n, loss="infonce", exchange="gather", kernels=kernels, launches=count.launches))
            rows[-1]["bytes"] = count.moved_bytes
    return rows


def guarded(name, fn, report):
    """fn(), or None with its error recorded under `name` (the run goes on)."""
    try:
        return fn()
    except Exception as err:  # noqa: BLE001 - recorded and skipped: one failure must not cost the whole run
        report["skipped"][name] = f"{type(err).__name__}: {err}"[:500]
        print(f"SKIPPED {name}: {type(err).__name__}: {err}", file=sys.stderr)
        traceback.print_exc()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return None


def table(title: str, header: tuple, rows: list) -> list[str]:
    """A Markdown table: a title line, the header, and one line per row of cells."""
    lines = ["", title, "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(map(str, row)) + " |" for row in rows]


def markdown(report) -> str:
    exact = [
        (r["dtype"], r["loss"], r["exchange"], r["kernels"], f"{r['rel_truth']:.1e}", f"{r['rel_torch_tiles']:.1e}")
        + (f"{r['rel_autocast']:.1e}" if "rel_autocast" in r else "", r["ok"])
        for r in report.get("exact") or []
    ]
    timing = report.get("timing", {})
    base = timing.get("open_clip ClipLoss, bf16 autocast", {}).get("seconds")
    timed = [
        (r["setting"], name, f"{r['seconds']:.4f}", f"{r['seconds'] / base:.2f}" if base else "")
        + (f"{r['peak_bytes'] / 2**30:.2f}" if r.get("peak_bytes") is not None else "",)
        for name, r in timing.items()
    ]
    swept = [
        (r["loss"], r.get("kernels", "triton"), r["blocks"], f"{r['rel_truth']:.1e}", r["ok"], f"{r['seconds']:.4f}")
        + (f"{r['seconds'] / base:.2f}" if base else "",)
        for r in report.get("sweep") or []
    ]
    counted = [
        (r["n"], r["loss"], r["exchange"], r["kernels"], f"{r['launches']:,}", f"{r['bytes'] / 2**20:,.1f}")
        for r in report.get("launches") or []
    ]
    lines = [f"# Fused kernels on {report['device']}", "", f"`{report['command']}`; {report['versions']}"]
    header = ("dtype", "loss", "exchange", "KERNELS", "rel. to truth", "rel. to torch tiles", "autocast's", "ok")
    lines += table("## (a) exact at P = 1 (G_x, G_y against plain autograd in float64)", header, exact)
    header = ("setting", "method", "seconds", "x ClipLoss", "peak GiB")
    lines += table("## (b) one rank's machinery, bf16 embeddings", header, timed)
    if swept:
        header = ("loss", "KERNELS", "blocks", "rel. to truth", "ok", "seconds", "x ClipLoss")
        lines += table("## (b2) launch configurations (bf16, gather, one rank)", header, swept)
    header = ("N", "loss", "exchange", "path", "launches", "MiB moved")
    lines += table("## (c) launches and bytes per step (one rank, counted on the meta device)", header, counted)
    return "\n".join(lines + ["", "## Skipped", ""] + [f"- {k}: {v}" for k, v in report["skipped"].items()]) + "\n"


def card(cpu_dry_run: bool) -> tuple[torch.device, dict]:
    """The device a run times (the CUDA card, or the CPU under Triton's interpreter for a dry run) and its
    report's first rows: the card's name, the command, the versions."""
    device = torch.device("cpu" if cpu_dry_run else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --cpu-dry-run (and TRITON_INTERPRET=1) on a CPU")
    import triton

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (Triton's interpreter)"
    versions = f"torch {torch.__version__}, triton {triton.__version__}"
    return device, dict(device=name, command=" ".join(sys.argv), versions=versions, skipped={})


def written(report: dict, stem: Path, markdown) -> int:
    """Write the report as stem.json and stem.md, print the markdown; exit 1 unless every exact row held."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(report, indent=1, default=str))
    stem.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))
    failed = [r for r in report["exact"] or [] if not r["ok"]]
    return 1 if failed or report["exact"] is None else 0


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="folder for kernels_gpu.json and kernels_gpu.md")
    parser.add_argument("--cpu-dry-run", action="store_true", help="tiny sizes on the CPU (TRITON_INTERPRET=1)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per method")
    parser.add_argument("--budget", type=float, help="seconds after which (b) skips what is left (GPU: 150)")
    parser.add_argument("--sweep", action="store_true", help="then time the launch configurations of GRID")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    device, report = card(args.cpu_dry_run)
    shape, started = SHAPES["cpu" if args.cpu_dry_run else "gpu"], time.perf_counter()
    budget = args.budget or (float("inf") if args.cpu_dry_run else 150.0)  # the dry run runs every path
    report["shape"] = shape
    report["exact"] = guarded("(a) exact", lambda: check_exact(shape, device), report)
    calls, report["timing"] = guarded("(b) set-up", lambda: methods(shape, device), report) or {}, {}
    for method, (setting, call) in calls.items():
        if time.perf_counter() - started > budget:  # the lent GPU's minutes are few: stop, say so
            report["skipped"][method] = f"not run: the {budget:.0f} s budget was spent"
            continue
        got = guarded(method, lambda call=call: measure(call, device, args.repeats), report)
        if got is not None:
            report["timing"][method] = dict(setting=setting, **got)
            print(f"{setting:18s} {method:60s} {got['seconds']:.4f} s", flush=True)
    if args.sweep:
        deadline = started + 2 * budget
        report["sweep"] = guarded("(b2) sweep", lambda: sweep(shape, device, args.repeats, deadline), report)
    report["launches"] = guarded("(c) launches", lambda: launch_counts(shape), report)
    report["wall_seconds"] = time.perf_counter() - started
    return written(report, Path(args.out) / "kernels_gpu", markdown)


if __name__ == "__main__":
    sys.exit(main())
