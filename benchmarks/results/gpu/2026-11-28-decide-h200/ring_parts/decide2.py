"""Second H200 run (issue 35): where the ring's time goes, tiles for the ring's fold, tf32, and small d.
Run from the repository root: PYTHONPATH=src:benchmarks python3 .dev/decide2.py OUT [--cpu-dry-run]."""
import json, math, sys, time
from pathlib import Path
import torch
sys.path.insert(0, str(Path.cwd() / "benchmarks"))
import kernels_gpu as kg
from distlab.streamed.kernels import coefficients
from distlab.streamed.kernels.launch import Blocks
from distlab.streamed.kernels.lse import row_lse
from distlab.streamed.rank_work import TAU, one_rank
from distlab.streamed.tile_ops import TritonTiles, TorchTiles
from distlab.streamed.tiles import Pairing

dry = "--cpu-dry-run" in sys.argv
out = Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
dev = torch.device("cpu" if dry else "cuda")
n, world = (128, 4) if dry else (65536, 8)
rows, t0 = [], time.perf_counter()
B = (lambda *a, **k: Blocks(32, 32, 32, 1, 1, **k)) if dry else (lambda *a, **k: Blocks(*a, **k))

def row(name, call, flops):
    try:
        got = kg.measure(call, dev, 3)
    except Exception as e:  # noqa: BLE001
        print(f"{name:60s} ERROR {type(e).__name__}: {str(e)[:200]}", flush=True); return
    got |= dict(name=name, tflops=flops / got["seconds"] / 1e12)
    rows.append(got)
    print(f"{name:60s} {got['seconds']:.4f} s {got['tflops']:6.1f} TFLOP/s  {(got.get('peak_bytes') or 0) / 2**30:.2f} GiB", flush=True)

def pairing(c, nk, offset=0):
    lse = 1 / TAU + math.log(nk); f = dict(dtype=torch.float32, device=dev)
    return Pairing(torch.full((c,), lse, **f), torch.full((nk,), lse, **f), torch.zeros(c, **f), offset)

for d in ([32] if dry else [1024, 512, 256, 128]):
    z = kg.embeddings(n, d, dev, torch.bfloat16)
    c = n // world; q, k = z[0][:c].contiguous(), z[1][:c].contiguous()  # one ring visit: C x C
    cnd = 2 * c * n * d  # FLOPs of one C N d
    def mach(loss, exch, ops, p=world):
        cfg = kg.config(n, p, exch, ops.name, ops.precision)
        return lambda: one_rank(cfg, *z, loss, ops)
    blocksets = [None] if dry else [None, B(128, 128, 64, 8, 3), B(128, 256, 64, 8, 4)]
    for b in blocksets:
        tag = "default" if b is None else f"{b.m}x{b.n}x{b.d}w{b.warps}s{b.stages}"
        mm = TritonTiles("bf16", blocks=b, w_in_memory=True)
        row(f"d={d} InfoNCE ring triton-mm {tag}", mach("infonce", "ring", mm), 4 * cnd)
        if d == (32 if dry else 1024):
            row(f"d={d} ring visit fold (row_lse columns) {tag}", lambda b=b: row_lse(q, k, 1 / TAU, 0, "bf16", columns=True, blocks=b), 2 * c * c * d)
            row(f"d={d} ring visit pair_products {tag}", lambda b=b: coefficients.pair_products(q, k, 1 / TAU, pairing(c, c), "bf16", blocks=b), 6 * c * c * d)
            row(f"d={d} sigmoid ring triton-mm {tag}", mach("sigmoid", "ring", mm), 3 * cnd)
    row(f"d={d} InfoNCE ring fused (triton)", mach("infonce", "ring", TritonTiles("bf16")), 4 * cnd)
    row(f"d={d} InfoNCE gather triton-mm", mach("infonce", "gather", TritonTiles("bf16", w_in_memory=True)), 6 * cnd)
    row(f"d={d} InfoNCE gather fused (triton)", mach("infonce", "gather", TritonTiles("bf16")), 6 * cnd)
    row(f"d={d} sigmoid ring fused (triton)", mach("sigmoid", "ring", TritonTiles("bf16")), 3 * cnd)
    row(f"d={d} sigmoid ring triton-mm", mach("sigmoid", "ring", TritonTiles("bf16", w_in_memory=True)), 3 * cnd)
    row(f"d={d} ClipLoss recipe bf16", lambda: kg.clip_recipe(*z, world), 6 * cnd)
    if d == (32 if dry else 1024):
        zf = kg.embeddings(n, d, dev, torch.float32)
        def machf(ops):
            cfg = kg.config(n, world, "ring", ops.name, ops.precision)
            return lambda: one_rank(cfg, *zf, "infonce", ops)
        row(f"d={d} tf32 InfoNCE ring triton-mm", machf(TritonTiles("tf32", w_in_memory=True)), 4 * cnd)
        row(f"d={d} tf32 InfoNCE ring fused", machf(TritonTiles("tf32")), 4 * cnd)
        if not dry:
            torch.backends.cuda.matmul.allow_tf32 = True
            row(f"d={d} tf32 InfoNCE ring torch tiles T=4096", machf(TorchTiles(4096, "tf32")), 4 * cnd)
    del z
    if not dry: torch.cuda.empty_cache()
    if time.perf_counter() - t0 > (120 if not dry else 60): print("budget: stop"); break
(out / "decide2.json").write_text(json.dumps(rows, indent=1))
print(f"wall {time.perf_counter() - t0:.0f} s")
