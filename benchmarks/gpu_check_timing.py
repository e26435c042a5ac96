"""(d) Time and memory of the streamed loss machinery against the C x N ClipLoss recipe, one GPU (P = 1).

Two settings per N:
  P = 1        the library's own `loss_machinery` (C = N: all N rows, N x N tiles walked) against open_clip's
               recipe at P = 1 (`clip_loss`: N x N logits, autograd), float32 and bf16 autocast.
  one rank of  the work one rank of P = 8 does (C = N / 8 rows against N columns) with the library's tile
  P = 8        functions (`streamed_lse` twice = phase 2 sharded, `streamed_softmax_pair_product` twice = phase 3;
               no exchange: a, b for the other ranks' rows are stand-ins of the right shape) against
               `local_clip_loss` on C x N logits (open_clip's local_loss=True; the gathered features
               require grad, as gather_with_grad's do).
Yardsticks: the 6 C N d multiply-adds as plain mm in the same tiles (float32 and bf16): the arithmetic alone.
Each row: median wall time of REPEATS runs after one warm-up (torch.cuda.synchronize around each),
torch.cuda.max_memory_allocated above what was allocated before the call, and the number of torch ops
that launch a kernel (counted once, by a dispatch mode, in the warm-up's shape). OOM is recorded, not fatal.
Usage: gpu_check_timing.py DEVICE OUT_DIR [--sizes N ...] [--dim d] [--repeats R]"""

import argparse
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from distlab.contrastive.losses import clip_loss, local_clip_loss
from distlab.pieces.chunks import chunks
from distlab.processes.spawn import spawn
from distlab.proof.launch_count import NO_KERNEL  # ops that launch no kernel: the launch count's own list
from distlab.streamed import loss_machinery
from distlab.streamed.torch_tiles import streamed_lse, streamed_softmax_pair_product

TAU = 0.07
OPS_PER_CELL = (
    37.5  # launching ops per T x T cell of the C x N grid (phase 2: 2 x 11.3, phase 3: 2 x 7.4), counted on CPU
)
LAUNCH_BUDGET = 400_000


class Launches(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not (func.is_view or func._schema.name.split("::")[1] in NO_KERNEL):
            self.n += 1
        return func(*args, **(kwargs or {}))


def embeddings(n, d, dev, dtype=torch.float32):
    gen = torch.Generator().manual_seed(n)
    z_x = F.normalize(torch.randn(n, d, generator=gen), dim=1)
    z_y = F.normalize(z_x + torch.randn(n, d, generator=gen), dim=1)
    return z_x.to(dev, dtype), z_y.to(dev, dtype)


def streamed_p1(z_x, z_y, t):
    n = len(z_x)
    cfg = {"GLOBAL_BATCH_SIZE": n, "MICRO_BATCH_SIZE": n, "STREAM_CHUNK_SIZE": t, "TAU": TAU}
    return loss_machinery(z_x, z_y, cfg)


def clip_p1(z_x, z_y, bf16):
    lx, ly = z_x.clone().requires_grad_(), z_y.clone().requires_grad_()
    with torch.autocast(z_x.device.type, dtype=torch.bfloat16, enabled=bf16):
        loss = clip_loss(lx, ly, 1 / TAU)
    loss.backward()
    return loss.item(), lx.grad, ly.grad


def streamed_rank(z_x, z_y, c, t):
    """One rank's (rank 0 of P = N / C) phase 2 (sharded) and phase 3, no exchange."""
    s, n = 1 / TAU, len(z_x)
    own = slice(0, c)
    a_own, nll_x = streamed_lse(z_x[own], z_y, s, t, 0)
    b_own, nll_y = streamed_lse(z_y[own], z_x, s, t, 0)
    reps = n // c
    a, b = a_own.repeat(reps), b_own.repeat(reps)  # stand-ins for the other ranks' a, b (shapes only)
    coef = torch.expm1(-nll_x) + torch.expm1(-nll_y)
    g_x = streamed_softmax_pair_product(z_x[own] * s, z_y, a[own], b, coef, 0, t).mul_(s / (2 * n))
    g_y = streamed_softmax_pair_product(z_y[own] * s, z_x, b[own], a, coef, 0, t).mul_(s / (2 * n))
    return ((nll_x + nll_y).sum() / (2 * n)).item(), g_x, g_y


def clip_rank(z_x, z_y, c, bf16):
    lx, ly = z_x[:c].clone().requires_grad_(), z_y[:c].clone().requires_grad_()
    ax, ay = z_x.clone().requires_grad_(), z_y.clone().requires_grad_()
    with torch.autocast(z_x.device.type, dtype=torch.bfloat16, enabled=bf16):
        loss = local_clip_loss(lx, ly, ax, ay, 1 / TAU, 0)
    loss.backward()
    return loss.item(), lx.grad, ly.grad


def floor(z_x, z_y, c, t, dtype):
    """6 C N d multiply-adds as plain mm in T x T tiles (phase 2's 2, phase 3's 4); not a gradient."""
    q_x, q_y, k_x, k_y = z_x[:c].to(dtype), z_y[:c].to(dtype), z_x.to(dtype), z_y.to(dtype)
    g_x, g_y = torch.zeros_like(q_x), torch.zeros_like(q_y)
    tiles = [(r, k) for r in chunks(c, t) for k in chunks(len(k_x), t)]
    for r, k in tiles:
        torch.mm(q_x[r], k_y[k].T)
        torch.mm(q_y[r], k_x[k].T)
    for r, k in tiles:
        g_x[r].addmm_(torch.mm(q_x[r], k_y[k].T), k_y[k])
        g_y[r].addmm_(torch.mm(q_y[r], k_x[k].T), k_x[k])
    return g_x, g_y


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def measure(fn, dev, repeats):
    """(median seconds, peak bytes above the start, launching ops) or raises (OOM)."""
    sync(dev)
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
    base = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0
    with Launches() as count:
        out = fn()
    del out
    sync(dev)
    peak = torch.cuda.max_memory_allocated(dev) - base if dev.type == "cuda" else float("nan")
    times = []
    for _ in range(repeats):
        sync(dev)
        t0 = time.perf_counter()
        out = fn()
        sync(dev)
        times.append(time.perf_counter() - t0)
        del out
    return statistics.median(times), peak, count.n


def rank_fn(rt, sizes, dim, repeats, ts):
    dev = rt.device
    rows = []
    info = dict(
        device=str(dev),
        name=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        torch=torch.__version__,
        backend=rt.backend,
        dim=dim,
        repeats=repeats,
        allow_tf32_default=torch.backends.cuda.matmul.allow_tf32,
    )
    for n in sizes:
        z_x, z_y = embeddings(n, dim, dev)
        c8 = n // 8
        calls = []
        for setting, c in (("P = 1 (C = N)", n), ("one rank of P = 8 (C = N/8)", c8)):
            for t in ts:
                cells = math.ceil(c / t) * math.ceil(n / t)
                label = f"streamed, T = {t}" + ("" if t < c else " (= C)" if t == c else " (> C)")
                if cells * OPS_PER_CELL > LAUNCH_BUDGET:
                    calls.append((setting, label, None, f"skipped: ~{cells * OPS_PER_CELL:,.0f} launches"))
                    continue
                fn = (
                    (lambda t=t, z_x=z_x, z_y=z_y: streamed_p1(z_x, z_y, t))
                    if c == n
                    else (lambda t=t, c=c, z_x=z_x, z_y=z_y: streamed_rank(z_x, z_y, c, t))
                )
                calls.append((setting, label, fn, None))
                if t == max(ts):  # the same with TF32 tensor cores for the float32 tile matmuls
                    calls.append((setting, label + ", TF32 on", ("tf32", fn), None))
            for bf16 in (False, True):
                fn = (
                    (lambda b=bf16, z_x=z_x, z_y=z_y: clip_p1(z_x, z_y, b))
                    if c == n
                    else (lambda b=bf16, c=c, z_x=z_x, z_y=z_y: clip_rank(z_x, z_y, c, b))
                )
                calls.append(
                    (
                        setting,
                        f"ClipLoss {'C x N' if c < n else 'N x N'} logits, {'bf16 autocast' if bf16 else 'float32'}",
                        fn,
                        None,
                    )
                )
            t = max(ts)
            for dt in (torch.float32, torch.bfloat16):
                calls.append(
                    (
                        setting,
                        f"6 C N d floor, mm in T = {t} tiles, {str(dt).split('.')[-1]}",
                        lambda c=c, t=t, dt=dt, z_x=z_x, z_y=z_y: floor(z_x, z_y, c, t, dt),
                        None,
                    )
                )
        for setting, label, fn, note in calls:
            row = dict(n=n, setting=setting, method=label, c=n if setting.startswith("P = 1") else c8)
            if fn is None:
                row["note"] = note
            else:
                tf32 = isinstance(fn, tuple)
                call = fn[1] if tf32 else fn
                old = torch.backends.cuda.matmul.allow_tf32
                torch.backends.cuda.matmul.allow_tf32 = tf32 or old
                try:
                    sec, peak, launches = measure(call, dev, repeats)
                    flops = 2 * 6 * row["c"] * n * dim
                    row.update(seconds=sec, peak_bytes=peak, launches=launches, tflops=flops / sec / 1e12)
                except torch.cuda.OutOfMemoryError as err:
                    row["note"] = "OOM: " + str(err).split("\n")[0][:120]
                except RuntimeError as err:  # CPU runs: an allocation failure reads so
                    row["note"] = f"{type(err).__name__}: {str(err)[:120]}"
                finally:
                    torch.backends.cuda.matmul.allow_tf32 = old
                    if dev.type == "cuda":
                        torch.cuda.empty_cache()
            rows.append(row)
            print(json.dumps(row), flush=True)
        del z_x, z_y
    return dict(info=info, rows=rows)


def table(result) -> str:
    info = result["info"]
    lines = [
        f"device {info['name']} ({info['device']}), torch {info['torch']}, {info['backend']}, d = {info['dim']}, "
        f"median of {info['repeats']} after a warm-up; memory = max_memory_allocated above the start; "
        f"TFLOP/s counts 6 C N d multiply-adds (2 flops each) whatever the method does; "
        "launches = torch ops that start a kernel, counted in the warm-up. "
        f"TF32 default: {info['allow_tf32_default']}.",
        "",
        "| N | setting | method | seconds | x ClipLoss bf16 | peak GiB | launches | TFLOP/s (6 C N d) | note |",
        "|---:|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in result["rows"]:
        base = next(
            (
                b
                for b in result["rows"]
                if b["n"] == r["n"]
                and b["setting"] == r["setting"]
                and b["method"].startswith("ClipLoss")
                and "bf16" in b["method"]
                and "seconds" in b
            ),
            None,
        )
        if "seconds" in r:
            ratio = f"{r['seconds'] / base['seconds']:.2f}" if base else "-"
            gib = f"{r['peak_bytes'] / 2**30:.2f}" if r["peak_bytes"] == r["peak_bytes"] else "-"
            lines.append(
                f"| {r['n']} | {r['setting']} | {r['method']} | {r['seconds']:.4f} | {ratio} | {gib} | "
                f"{r['launches']:,} | {r['tflops']:.1f} | |"
            )
        else:
            lines.append(f"| {r['n']} | {r['setting']} | {r['method']} | - | - | - | - | - | {r['note']} |")
    return "\n".join(lines) + "\n"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("device")
    p.add_argument("out")
    p.add_argument("--sizes", type=int, nargs="+", default=[8192, 32768, 65536])
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--chunks", type=int, nargs="+", default=[1024, 4096], help="T values for the streamed rows")
    p.add_argument("--limit-s", type=float, default=300)
    a = p.parse_args()
    result = spawn(rank_fn, 1, a.sizes, a.dim, a.repeats, a.chunks, device=a.device, timeout_s=120, limit_s=a.limit_s)[
        0
    ]
    text = table(result)
    print(text)
    with open(os.path.join(a.out, "timing.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(a.out, "timing.md"), "w") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
