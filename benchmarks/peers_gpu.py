"""The streamed loss machinery against the packages that do the same job, one process, C = N (P = 1).

The peers, each imported from wherever it is installed (`benchmarks/gpu_check.sh` installs the wheels of
the ignored folder `.whl/` into /tmp/site and puts it on PYTHONPATH); one that does not import is listed as
missing, with its error, and the rest run:

    InfoNCE  open_clip's ClipLoss(local_loss=True, gather_with_grad=True, world_size=1) under bf16 autocast
             (no process group at world size 1: its gather is skipped), and memeff's MemoryEfficientCLIPLoss
             in its exact mode (stable=False: the true gradient; its default rescales it)
    sigmoid  open_clip's SigLipLoss(world_size=1) under bf16 autocast, and siglip-kernel's fused_siglip_loss

against distlab's `loss_machinery` (InfoNCE; the sigmoid with a logit bias), with the default KERNELS and
T where the installed distlab has them. Each method takes unit-norm N x d bf16 embeddings and returns
(or leaves in .grad) dL/dZ_x and dL/dZ_y; before anything is timed, each one's dL/dZ_x is compared with
plain autograd in float64 on the same embeddings (at the first N). Time: median of REPEATS forward +
backward after one warm-up, the GPU synchronized around each; memory: torch.cuda.max_memory_allocated
above what was allocated before the call. (On a CPU, `--cpu-dry-run` sizes: the CUDA-only peers are
reported as needing CUDA; nothing is timed against them.)

The issue's targets are at one rank's shape of N = 65,536, P = 8 (C = 8,192 rows against N columns);
the peers' distributed classes need a process group of 8 for that shape, which one GPU cannot hold, so
this compares at P = 1, where every method does C = N, and says so beside each verdict.

Usage: peers_gpu.py --out DIR [--sizes N ...] [--dim d] [--repeats R] [--limit-s S]
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from distlab.contrastive.losses import clip_loss, sigmoid_loss
from distlab.processes.spawn import spawn
from distlab.streamed import loss_machinery

TAU, SIG_S, SIG_BETA = 0.07, 10.0, -10.0


def open_clip_loss_module():
    """open_clip's loss.py alone: `import open_clip` pulls in its tokenizers and timm, which an image may
    lack; loss.py needs only torch."""
    spec = importlib.util.find_spec("open_clip")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("open_clip is not installed")
    path = os.path.join(list(spec.submodule_search_locations)[0], "loss.py")
    module_spec = importlib.util.spec_from_file_location("open_clip_loss_only", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def peers() -> tuple[dict, dict]:
    """({name: loss function of (z_x, z_y) -> loss}, {name: why it is missing})."""
    found, missing = {}, {}
    try:
        oc = open_clip_loss_module()
        clip = oc.ClipLoss(local_loss=True, gather_with_grad=True, rank=0, world_size=1)
        siglip = oc.SigLipLoss(rank=0, world_size=1)
        found["open_clip ClipLoss, bf16 autocast"] = ("infonce", lambda x, y: _autocast(clip, x, y, 1 / TAU))
        found["open_clip SigLipLoss, bf16 autocast"] = (
            "sigmoid",
            lambda x, y: _autocast(siglip, x, y, SIG_S, SIG_BETA),
        )
    except Exception as err:  # noqa: BLE001 - reported, the others run
        missing["open_clip"] = f"{type(err).__name__}: {err}"
    try:
        memeff = importlib.import_module("memeff")
        exact = memeff.MemoryEfficientCLIPLoss(temperature=TAU, normalized_inputs=True, stable=False)
        found["memeff MemoryEfficientCLIPLoss, stable=False"] = ("infonce", exact)
    except Exception as err:  # noqa: BLE001
        missing["memeff"] = f"{type(err).__name__}: {err}"
    try:
        kernel = importlib.import_module("siglip_kernel")
        found["siglip-kernel fused_siglip_loss"] = ("sigmoid", lambda x, y: _siglip_kernel(kernel, x, y))
    except Exception as err:  # noqa: BLE001
        missing["siglip-kernel"] = f"{type(err).__name__}: {err}"
    return found, missing


def _autocast(loss, x, y, *scalars):
    tensors = [torch.tensor(v, device=x.device, dtype=torch.float32) for v in scalars]
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        return loss(x, y, *tensors)


def _siglip_kernel(kernel, x, y):
    log_s = torch.tensor(math.log(SIG_S), device=x.device, dtype=torch.float32, requires_grad=True)
    beta = torch.tensor(SIG_BETA, device=x.device, dtype=torch.float32, requires_grad=True)
    return kernel.fused_siglip_loss(x, y, log_s, beta)


def distlab_method(loss: str):
    """distlab's loss machinery at P = 1 (a group of one), the installed defaults for the tiles."""

    def run(x, y):
        config = {
            "GLOBAL_BATCH_SIZE": len(x),
            "MICRO_BATCH_SIZE": len(x),
            "TAU": TAU if loss == "infonce" else 1 / SIG_S,
        }
        try:
            return loss_machinery(x, y, config, logit_bias=SIG_BETA if loss == "sigmoid" else None)
        except ValueError as err:  # a distlab that still requires T
            if "STREAM_CHUNK_SIZE" not in str(err):
                raise
            return loss_machinery(x, y, config | {"STREAM_CHUNK_SIZE": 4096}, SIG_BETA if loss == "sigmoid" else None)

    run.returns_grads = True
    return run


def grads_of(method, x, y) -> tuple[torch.Tensor, torch.Tensor]:
    """dL/dZ_x, dL/dZ_y of `method`: a loss to back-propagate, or distlab's machinery, which takes the
    embeddings as data (no graph) and returns (L, G_x, G_y)."""
    if getattr(method, "returns_grads", False):
        _, g_x, g_y = method(x.detach(), y.detach())
        return g_x, g_y
    lx, ly = x.detach().clone().requires_grad_(), y.detach().clone().requires_grad_()
    method(lx, ly).float().backward()
    return lx.grad, ly.grad


def reference_grad(kind: str, x, y) -> torch.Tensor:
    """dL/dZ_x by plain autograd in float64 on the same (bf16-valued) embeddings."""
    lx, ly = x.double().requires_grad_(), y.double()
    loss = clip_loss(lx, ly, 1 / TAU) if kind == "infonce" else sigmoid_loss(lx, ly, SIG_S, SIG_BETA)
    loss.backward()
    return lx.grad


def embeddings(n: int, d: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(n)
    z_x = F.normalize(torch.randn(n, d, generator=gen), dim=1)
    z_y = F.normalize(z_x + torch.randn(n, d, generator=gen), dim=1)
    return z_x.to(device, torch.bfloat16), z_y.to(device, torch.bfloat16)


def measure(method, x, y, repeats: int) -> tuple[float, int]:
    """(median seconds, peak bytes above the start) of forward + backward; CUDA only for the memory."""
    cuda = x.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    grads_of(method, x, y)  # warm-up: autotuning, first-call allocations
    sync()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if cuda else 0
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        grads_of(method, x, y)
        sync()
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() - base if cuda else -1
    return statistics.median(times), peak


def rank_fn(rt, sizes: list[int], dim: int, repeats: int, limit_s: float) -> dict:
    start, dev = time.monotonic(), rt.device
    found, missing = peers()
    methods = {"distlab loss_machinery, InfoNCE": ("infonce", distlab_method("infonce"))}
    methods |= {k: v for k, v in found.items() if v[0] == "infonce"}
    methods["distlab loss_machinery, sigmoid"] = ("sigmoid", distlab_method("sigmoid"))
    methods |= {k: v for k, v in found.items() if v[0] == "sigmoid"}
    rows = []
    for k, n in enumerate(sizes):
        x, y = embeddings(n, dim, dev)
        refs = {kind: reference_grad(kind, x, y) for kind in ("infonce", "sigmoid")} if k == 0 else {}
        for name, (kind, method) in methods.items():
            row = {"n": n, "method": name, "loss": kind}
            if time.monotonic() - start > limit_s:
                rows.append(row | {"note": "skipped: out of time"})
                continue
            try:
                if refs:
                    g_x = grads_of(method, x, y)[0].double()
                    row["rel_err_gx"] = ((g_x - refs[kind]).norm() / refs[kind].norm()).item()
                row["seconds"], row["peak_bytes"] = measure(method, x, y, repeats)
            except Exception as err:  # noqa: BLE001 - an OOM or a CUDA-only kernel on the CPU: recorded
                row["note"] = f"{type(err).__name__}: {str(err).splitlines()[0][:100]}"
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
            rows.append(row)
            print(json.dumps(row), flush=True)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    info = {"device": name, "torch": torch.__version__, "dim": dim, "repeats": repeats, "dtype": "bfloat16"}
    return {"info": info, "missing": missing, "rows": rows}


def verdicts(result: dict) -> list[str]:
    """The issue's P = 8 targets, read at P = 1 (C = N) where each side was measured."""
    out = []
    by = {(r["n"], r["method"]): r for r in result["rows"] if "seconds" in r}
    pairs = (
        ("distlab loss_machinery, InfoNCE", "open_clip ClipLoss, bf16 autocast", 1.0, 1 / 8),
        ("distlab loss_machinery, InfoNCE", "memeff MemoryEfficientCLIPLoss, stable=False", 1.0, None),
        ("distlab loss_machinery, sigmoid", "siglip-kernel fused_siglip_loss", 1.0, None),
    )
    for n in sorted({r["n"] for r in result["rows"]}):
        for ours, theirs, time_at_most, memory_at_most in pairs:
            a, b = by.get((n, ours)), by.get((n, theirs))
            if a is None or b is None:
                out.append(f"N = {n}: {ours} vs {theirs}: not measured (missing or failed)")
                continue
            if result["info"]["device"] == "cpu":  # a dry run checks that it runs, not the targets
                out.append(f"N = {n}: {ours} / {theirs}: {a['seconds'] / b['seconds']:.2f}x time (CPU: no target)")
                continue
            t, m = a["seconds"] / b["seconds"], a["peak_bytes"] / max(b["peak_bytes"], 1)
            met = t <= time_at_most and (memory_at_most is None or m <= memory_at_most)
            want = f"<= {time_at_most:g}x time" + (f", <= 1/{1 / memory_at_most:g} memory" if memory_at_most else "")
            out.append(
                f"N = {n}, P = 1: {ours} / {theirs}: {t:.2f}x time, {m:.3f}x memory (target {want}): "
                f"{'met' if met else 'NOT met'}"
            )
    return out


def markdown(result: dict) -> str:
    info = result["info"]
    lines = [
        f"Peers at P = 1 (C = N), {info['device']}, torch {info['torch']}, d = {info['dim']}, bf16 embeddings, "
        f"median of {info['repeats']} after a warm-up; memory = max_memory_allocated above the start; "
        "rel err = |dL/dZ_x - float64 autograd| / |float64 autograd| at the first N.",
        "",
    ]
    lines += [f"- missing: {k}: {v}" for k, v in result["missing"].items()] or ["- every peer imported"]
    lines += ["", "| N | method | seconds | peak GiB | rel err dL/dZ_x | note |", "|---:|---|---:|---:|---:|---|"]
    for r in result["rows"]:
        sec = f"{r['seconds']:.4f}" if "seconds" in r else "-"
        gib = f"{r['peak_bytes'] / 2**30:.3f}" if r.get("peak_bytes", -1) >= 0 else "-"
        err = f"{r['rel_err_gx']:.1e}" if "rel_err_gx" in r else "-"
        lines.append(f"| {r['n']} | {r['method']} | {sec} | {gib} | {err} | {r.get('note', '')} |")
    return "\n".join(lines + [""] + [f"- {v}" for v in verdicts(result)]) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--sizes", type=int, nargs="+", default=[16384, 65536])
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--limit-s", type=float, default=120)
    a = p.parse_args()
    result = spawn(rank_fn, 1, a.sizes, a.dim, a.repeats, a.limit_s, device=a.device, limit_s=a.limit_s + 120)[0]
    text = markdown(result)
    print(text)
    with open(os.path.join(a.out, "peers.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(a.out, "peers.md"), "w") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
