"""The next decisive run for the loss kernels (issue 35, second pass), prepared on a CPU: on one CUDA card, the
paths built since the H200 record timed against that record's rows and against this card's own baselines.

    python benchmarks/gpu_next.py OUT --budget 150                              # one H100 / H200: about 2 min
    TRITON_INTERPRET=1 python benchmarks/gpu_next.py OUT --cpu-dry-run           # tiny, CPU: every row once

Rows, in the order of what they decide (each the median of --repeats after a warm-up that compiles; peak memory
above the start; a row that raises is recorded and skipped; rows past --budget are listed, not run):
  E  exact on this card first: every path against plain autograd in float64 (`kernels_gpu.check_exact`: float32
     to 1e-5, bf16 within 1.25x autocast's own error), and the sigmoid's loss value (its epilogue's approximate
     divisions and log1p series, `product.sigmoid_terms`) in float32 to 1e-5;
  A  this card's baselines: open_clip's ClipLoss and SigLipLoss recipes, cuBLAS floors of 6, 4 and 3 C N d;
  B  one rank of N = 65,536, P = 8, d = 1,024, bf16, the defaults as they now are (tiles from
     `kernels.tuning`, W in 512 MiB chunks, the column product added in place): InfoNCE ring and gather, the
     sigmoid ring; W_MEMORY_MIB 256 and 1,024 beside them;
  C  one ring visit (C x C): the fold (row and column statistics) in 128 x 128 and 128 x 256 tiles; both
     products from one W at 2,048, 4,096 and 8,192 rows of W;
  D  P = 1, N = 65,536: the InfoNCE ring against the 6 and 4 N^2 d floors, the sigmoid ring against
     siglip-kernel's fused loss (where its wheel imports);
  S  S in memory (KERNELS "triton-s", `kernels.s_in_memory`: cuBLAS S in chunks, one memory-bound Triton pass):
     the B and D rows again with it, one visit's fold and products, W_MEMORY_MIB 1,024 (the ring's S kept for
     pass 2 at more visits); its rows and B's W-in-memory rows are what `tuning.S_IN_MEMORY_MEASURED` takes;
  F  the search: `tuning.search` over its candidates for each kind at one ring visit, d = 1,024, 512, 256, 128,
     printed as WINNERS rows to commit (`kernels/tuning.py`).
Each row shows the figure on record (benchmarks/results/gpu/2026-11-28-decide-h200, an H200) beside it, and the
rows of a path its modelled floor (`kernels.path_model`) at this card's rates: cuBLAS's from the 6 C N d floor row,
the bandwidth from a copy row (group A), the Triton kernels' from the record (`path_model.RATES`), so each row says
how far it is from its own floor.
Writes OUT/gpu_next.json and OUT/gpu_next.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))  # kernels_gpu beside this file
import kernels_gpu as kg  # noqa: E402

from distlab.streamed.kernel_choice import TritonTiles  # noqa: E402
from distlab.streamed.kernels import coefficients, path_model, s_in_memory, tuning  # noqa: E402
from distlab.streamed.kernels.launch import Blocks  # noqa: E402
from distlab.streamed.kernels.lse import row_lse  # noqa: E402
from distlab.streamed.rank_work import TAU, one_rank  # noqa: E402
from distlab.streamed.torch_tiles import Pairing  # noqa: E402

SHAPES = {
    "gpu": dict(n=65536, world=8, d=1024, dims=(1024, 512, 256, 128)),
    "cpu": dict(n=64, world=4, d=16, dims=(16,)),  # the dry run: every row once, in the interpreter
}
ON_RECORD = {  # seconds on the H200 of 2026-11-28 (decide/ and ring_parts/), the rows this run is read against
    "open_clip ClipLoss, bf16 autocast": 0.0183,
    "open_clip SigLipLoss, bf16 autocast": 0.0135,
    "floor 6 C N d, cuBLAS": 0.0128,
    "floor 4 C N d, cuBLAS": 0.0060,
    "floor 3 C N d, cuBLAS": 0.0045,
    "InfoNCE ring, defaults": 0.0168,
    "InfoNCE gather, defaults": 0.0162,
    "sigmoid ring, defaults": 0.0088,
    "visit fold 128x128x64": 0.0010,
    "visit fold 128x256x64": 0.0013,
    "visit products, one W": 0.0011,
    "C x N product, w_rows 2048": 0.0048,
    "C x N product, w_rows 4096": 0.0044,
    "C x N product, w_rows 8192": 0.0044,
    "P = 1 InfoNCE ring": 0.1226,
    "P = 1 floor 6 N^2 d": 0.0808,
    "P = 1 floor 4 N^2 d": 0.0521,
    "P = 1 sigmoid ring": 0.0625,
    "P = 1 siglip-kernel fused_siglip_loss": 0.0461,
    "InfoNCE ring, fused": 0.0356,
}
# Rows that differ from another row only by a number (a budget, a tile, rows of W): the dry run, which proves
# the code paths and times nothing, leaves them out.
SAME_CODE = {
    "InfoNCE ring, W_MEMORY_MIB 256",
    "InfoNCE ring, W_MEMORY_MIB 1024",
    "InfoNCE ring, S in memory, W_MEMORY_MIB 1024",
    "visit fold 128x256x64",
    "C x N product, w_rows 4096",
    "C x N product, w_rows 8192",
    "P = 1 floor 4 N^2 d",
}
COPY_BYTES = {"gpu": 2**30, "cpu": 2**20}  # the bandwidth row: one clone of this many bytes, read once, written once
KINDS = ("fold", "ring-fold", "infonce-mm", "sigmoid-mm")


def floor(z_x, z_y, world, chunk, products):
    """cuBLAS bf16 S and products in column chunks: `products` = 6 (gathered: S for the folds and for G, both
    sides), 4 (the ring: S for both folds, S again for both products) or 3 (the sigmoid: S once, both products)."""
    c, d = len(z_x) // world, z_x.shape[1]
    q, g, g_cols = z_x[:c], torch.zeros(c, d, device=z_x.device), torch.zeros(chunk, d, device=z_x.device)
    for c0 in range(0, len(z_y), chunk):
        k = z_y[c0 : c0 + chunk]
        for _ in range(products // 2 - 1):  # the folds' S, made on its own
            torch.mm(q, k.T)
        s = torch.mm(q, k.T)
        coefficients.mm_into(g, s, k, add=True)  # float32 accumulation in place, as the kernels' products
        if products % 2 == 0 or products == 3:  # the columns' product from the same S
            coefficients.mm_into(g_cols[: len(k)], s.T, q, add=True)
    return g, g_cols


def exact_rows(shape, device) -> list[dict]:
    """E: the paths against float64 autograd, and the sigmoid's loss value (float32, the cheap log1p)."""
    rows = kg.check_exact(kg.SHAPES["cpu" if device.type == "cpu" else "gpu"], device)
    gen = torch.Generator().manual_seed(1)
    q, k = (F.normalize(torch.randn(n, 64, generator=gen, dtype=torch.float64), dim=1) for n in (300, 700))
    for s, beta in ((10.0, -10.0), (30.0, 0.0)):
        eps = torch.where(torch.arange(700)[None, :] == torch.arange(300)[:, None] + 11, 1.0, -1.0)
        truth = -F.logsigmoid(eps * (s * q @ k.T + beta)).sum()
        _, loss, _ = coefficients.sigmoid_rows(
            q.float().to(device), k.float().to(device), (s, beta), 700, 11, "float32"
        )
        err = abs(loss.item() - truth.item()) / truth.item()
        rows.append(dict(dtype="float32", loss=f"sigmoid loss value, s={s:g}, beta={beta:g}", exchange="-"))
        rows[-1] |= dict(kernels="triton-mm", rel_truth=err, rel_torch_tiles=float("nan"), ok=err <= 1e-5)
    return rows


def peers(z_x, z_y):
    """siglip-kernel's fused loss at P = 1 (forward and backward), where its wheel imports."""
    try:
        from siglip_kernel import fused_siglip_loss
    except Exception as err:  # noqa: BLE001 - not installed here, or no CUDA to ask the architecture of
        print(f"siglip-kernel not importable: {type(err).__name__}: {err}")
        return {}

    def siglip():
        x, y = z_x.clone().requires_grad_(), z_y.clone().requires_grad_()
        t = torch.tensor(2.302585092994046, device=x.device, requires_grad=True)  # log 10
        fused_siglip_loss(x, y, t, torch.tensor(-10.0, device=x.device, requires_grad=True)).backward()

    return {"P = 1 siglip-kernel fused_siglip_loss": ("D", siglip)}


def timed_rows(shape, device) -> dict:
    """A-D and S: name -> (group, a zero-argument call, the (path, path_model.Shape) it is modelled by or None)."""
    n, world, d = shape["n"], shape["world"], shape["d"]
    c, z = n // world, kg.embeddings(n, d, device, torch.bfloat16)
    q, k = z[0][:c].contiguous(), z[1][:c].contiguous()
    pairing = Pairing(*(torch.zeros(c, device=device) for _ in range(3)), 0)
    chunk = min(8192, c)
    copy = torch.empty(COPY_BYTES[device.type] // 4, device=device)

    def rank(loss, exchange, p=world, kernels="triton-mm", **tiles):
        ops = TritonTiles("bf16", w_in_memory=kernels == "triton-mm", s_in_memory=kernels == "triton-s", **tiles)
        cfg = kg.config(n, p, exchange, kernels, "bf16")
        budget = tiles.get("w_budget") or path_model.Shape.budget
        model = (kernels, path_model.Shape(loss, exchange, n, p, d, budget=budget))
        return lambda: one_rank(cfg, *z, loss, ops), model

    def row(group, made):
        return (group, *made) if isinstance(made, tuple) else (group, made, None)

    def product(rows):  # one rank's C x N product at `rows` rows of W (the record's group C)
        gemm = (128, 256, 64, 8, 3) if device.type == "cuda" else (32, 32, 32, 1, 1)
        wide = Pairing(pairing.lse_q, torch.zeros(n, device=device), pairing.diag_coef, 0)
        return lambda: coefficients.pair_product(q, z[1], 1 / TAU, wide, "bf16", blocks=Blocks(*gemm, w_rows=rows))

    def visit_fold(m, nn):
        blocks = Blocks(m, nn, 64, 8, 3) if device.type == "cuda" else Blocks(32, 32, 32, 1, 1)
        return lambda: row_lse(q, k, 1 / TAU, 0, "bf16", columns=True, blocks=blocks)

    p1 = 8192 if device.type == "cuda" else 32
    calls = {
        "copy, GB/s": row("A", lambda: copy.clone()),
        "open_clip ClipLoss, bf16 autocast": row("A", lambda: kg.clip_recipe(*z, world)),
        "open_clip SigLipLoss, bf16 autocast": row("A", lambda: kg.siglip_recipe(*z, world)),
        **{f"floor {p} C N d, cuBLAS": row("A", lambda p=p: floor(*z, world, chunk, p)) for p in (6, 4, 3)},
        "InfoNCE ring, defaults": row("B", rank("infonce", "ring")),
        "InfoNCE gather, defaults": row("B", rank("infonce", "gather")),
        "sigmoid ring, defaults": row("B", rank("sigmoid", "ring")),
        "InfoNCE ring, fused": row("B", rank("infonce", "ring", kernels="triton")),
        "InfoNCE ring, W_MEMORY_MIB 256": row("B", rank("infonce", "ring", w_budget=256 * 2**20)),
        "InfoNCE ring, W_MEMORY_MIB 1024": row("B", rank("infonce", "ring", w_budget=1024 * 2**20)),
        **s_rows(rank, q, k, pairing),
        "visit fold 128x128x64": row("C", visit_fold(128, 128)),
        "visit fold 128x256x64": row("C", visit_fold(128, 256)),
        "visit products, one W": row("C", lambda: coefficients.pair_products(q, k, 1 / TAU, pairing, "bf16")),
        **{f"C x N product, w_rows {r}": row("C", product(r)) for r in (2048, 4096, 8192)},
        "P = 1 InfoNCE ring": row("D", rank("infonce", "ring", 1)),
        "P = 1 floor 6 N^2 d": row("D", lambda: floor(*z, 1, p1, 6)),
        "P = 1 floor 4 N^2 d": row("D", lambda: floor(*z, 1, p1, 4)),
        "P = 1 sigmoid ring": row("D", rank("sigmoid", "ring", 1)),
        "P = 1 InfoNCE ring, S in memory": row("S", rank("infonce", "ring", 1, "triton-s")),
        "P = 1 sigmoid ring, S in memory": row("S", rank("sigmoid", "ring", 1, "triton-s")),
    }
    calls |= {name: ("D", call, None) for name, (_, call) in peers(*z).items()}
    return {name: row for name, row in calls.items() if device.type == "cuda" or name not in SAME_CODE}


def s_rows(rank, q, k, pairing) -> dict:
    """Group S at one rank's shape: the defaults' rows with S in memory, and one ring visit's pass and products."""
    fold = lambda: s_in_memory.row_lse(q, k, 1 / TAU, 0, "bf16", columns=True)  # noqa: E731 - one visit's fold
    job = coefficients.infonce_job(1 / TAU, pairing, 1.0, True)
    roomy = rank("infonce", "ring", kernels="triton-s", w_budget=2**30)  # four visits kept at C = 8,192, not two
    return {
        "InfoNCE ring, S in memory": ("S", *rank("infonce", "ring", kernels="triton-s")),
        "InfoNCE gather, S in memory": ("S", *rank("infonce", "gather", kernels="triton-s")),
        "sigmoid ring, S in memory": ("S", *rank("sigmoid", "ring", kernels="triton-s")),
        "InfoNCE ring, S in memory, W_MEMORY_MIB 1024": ("S", *roomy),
        "visit fold, S in memory": ("S", fold, None),
        "visit products, S in memory": ("S", lambda: s_in_memory.run(q, k, job, "bf16"), None),
    }


def card_rates(report, shape, device) -> path_model.Rates:
    """This card's rates for the model: cuBLAS's from its 6 C N d floor row, the bandwidth from its copy row (read
    and written), the Triton kernels' from the record for this card (else the H200's, said in `source`)."""
    timing, c = report["timing"], shape["n"] // shape["world"]
    name = report["device"] if device.type == "cuda" else "CPU"
    known = path_model.rates_for(name) or path_model.RATES["NVIDIA H200"]
    gemm = 6 * 2 * c * shape["n"] * shape["d"] / timing["floor 6 C N d, cuBLAS"]["seconds"]
    bandwidth = 2 * COPY_BYTES[device.type] / timing["copy, GB/s"]["seconds"]
    triton = "this card's record" if path_model.rates_for(name) else "the H200's record"
    source = f"{name}: GEMM and bandwidth measured in this run, the Triton kernels' rates from {triton}"
    return path_model.Rates(gemm, known.triton_gemm, known.fused, bandwidth, source)


def search_rows(shape, device, deadline) -> list[dict]:
    """F: a search per kind and d at one ring visit (C x C), timed on this device (perf_counter on a CPU)."""
    timer = tuning.cuda_timer if device.type == "cuda" else lambda call: kg.measure(call, device, 1)["seconds"]
    c, rows = shape["n"] // shape["world"], []
    for d in shape["dims"]:
        q, k = (t[:c].contiguous() for t in kg.embeddings(shape["n"], d, device, torch.bfloat16))
        pairing = Pairing(*(torch.zeros(c, device=device) for _ in range(3)), 0)
        runs = {  # q, k and the pairing bound now: each d's own operands
            "fold": lambda b, q=q, k=k: row_lse(q, k, 1 / TAU, 0, "bf16", blocks=b),
            "ring-fold": lambda b, q=q, k=k: row_lse(q, k, 1 / TAU, 0, "bf16", columns=True, blocks=b),
            "infonce-mm": lambda b, q=q, k=k, p=pairing: coefficients.pair_products(q, k, 1 / TAU, p, "bf16", blocks=b),
            "sigmoid-mm": lambda b, q=q, k=k: coefficients.sigmoid_rows_and_columns(
                q, k, (10.0, -10.0), c, 0, "bf16", b
            ),
        }
        for kind, run in runs.items():
            if time.perf_counter() > deadline:
                rows.append(dict(d=d, kind=kind, winner=None, timed="not run: the budget was spent"))
                continue
            trials = tuning.candidates(kind, Blocks(128, 256, 64, 8, 3))
            if device.type == "cpu":  # the interpreter: the same search over small tiles
                trials = [Blocks(32, 32, 32, 1, 1), Blocks(16, 32, 16, 1, 1), Blocks(32, 32, 32, 1, 1, w_rows=16)]
            best, timed = tuning.search(trials, run, timer)
            rows.append(dict(d=d, kind=kind, winner=repr(best), timed=[(repr(b), s) for b, s in timed]))
            print(f"search d={d} {kind:10s} -> {best}", flush=True)
    return rows


def markdown(report) -> str:
    lines = [f"# gpu_next on {report['device']}", "", f"`{report['command']}`; {report['versions']}", ""]
    lines += ["| kind | dtype | exchange | KERNELS | rel. to truth | ok |", "|---|---|---|---|---:|---|"]
    lines += [
        f"| {r['loss']} | {r['dtype']} | {r['exchange']} | {r['kernels']} | {r['rel_truth']:.1e} | {r['ok']} |"
        for r in report["exact"] or []
    ]
    lines += ["", f"Modelled floors at: {report.get('rates', 'no rates (a row they come from did not run)')}", ""]
    lines += ["| group | row | seconds | on record (H200) | floor (model) | x floor | peak GiB |"]
    lines += ["|---|---|---:|---:|---:|---:|---:|"]
    for name, r in report["timing"].items():
        record = f"{ON_RECORD[name]:.4f}" if name in ON_RECORD else ""
        peak = f"{r['peak_bytes'] / 2**30:.2f}" if r.get("peak_bytes") is not None else ""
        floor_s, times = (f"{r['floor']:.4f}", f"{r['seconds'] / r['floor']:.2f}") if r.get("floor") else ("", "")
        lines.append(f"| {r['group']} | {name} | {r['seconds']:.4f} | {record} | {floor_s} | {times} | {peak} |")
    lines += ["", "## F: winners of the search, as WINNERS rows (kernels/tuning.py)", "", "```"]
    lines += [f"({report['device']!r}, {r['kind']!r}): {{{r['d']}: {r['winner']}}}" for r in report["search"] or []]
    lines += ["```", "", f"in-place addmm with a float32 self: {report['mixed_addmm']}"]
    return "\n".join(lines + ["", "## Skipped", ""] + [f"- {k}: {v}" for k, v in report["skipped"].items()]) + "\n"


def print_row(row: dict, method: str, model, rates) -> None:
    """One timed row as it lands: its seconds, the figure on record, and where it has a model its floor and how
    many times the floor it took (the floor is also kept in the row for the table)."""
    floor_said = ""
    if model is not None and rates is not None:
        row["floor"] = path_model.floor(model[0], model[1], rates)
        floor_said = f", floor {row['floor']:.4f} s ({model[0]}): {row['seconds'] / row['floor']:.2f}x"
    record = ON_RECORD.get(method, "-")
    print(f"{row['group']} {method:45s} {row['seconds']:.4f} s  (on record {record}{floor_said})", flush=True)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="folder for gpu_next.json and gpu_next.md")
    parser.add_argument("--cpu-dry-run", action="store_true", help="tiny sizes on the CPU (TRITON_INTERPRET=1)")
    parser.add_argument("--repeats", type=int, help="timed runs per row (default 3; 1 in the dry run)")
    parser.add_argument("--budget", type=float, default=150.0, help="seconds after which rows are skipped")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    device, report = kg.card(args.cpu_dry_run)
    shape, started = SHAPES["cpu" if args.cpu_dry_run else "gpu"], time.perf_counter()
    repeats = args.repeats or (1 if args.cpu_dry_run else 3)
    args.budget = float("inf") if args.cpu_dry_run else args.budget  # the dry run proves every row runs
    report["timing"] = {}
    report["mixed_addmm"] = coefficients.mixed_addmm(device if device.type == "cuda" else torch.device("meta"))
    report["exact"] = kg.guarded("E exact", lambda: exact_rows(shape, device), report)
    calls = kg.guarded("A-D set-up", lambda: timed_rows(shape, device), report) or {}
    rates = None
    for method, (group, call, model) in calls.items():
        if time.perf_counter() - started > args.budget:
            report["skipped"][method] = f"not run: the {args.budget:.0f} s budget was spent"
            continue
        got = kg.guarded(method, lambda call=call: kg.measure(call, device, repeats), report)
        if got is None:
            continue
        report["timing"][method] = dict(group=group, **got)
        if rates is None and {"copy, GB/s", "floor 6 C N d, cuBLAS"} <= set(report["timing"]):
            rates = kg.guarded("rates", lambda: card_rates(report, shape, device), report)
            report["rates"] = rates.source if rates else None
        print_row(report["timing"][method], method, model, rates)
    deadline = started + 1.5 * args.budget
    report["search"] = kg.guarded("F search", lambda: search_rows(shape, device, deadline), report)
    report["wall_seconds"] = time.perf_counter() - started
    return kg.written(report, Path(args.out) / "gpu_next", markdown)


if __name__ == "__main__":
    sys.exit(main())
