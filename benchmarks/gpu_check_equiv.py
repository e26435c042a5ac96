"""The library's step at P ranks on DEVICE against plain autograd on the whole batch, under spawn (torchrun's
environment, distlab.processes.runtime.distributed(DEVICE): on a GPU the group is cpu:gloo,cuda:nccl). (a) runs it
at P = 1 on cuda; (b) at P = 2, 4, 8 on the CPU (gloo). Usage: gpu_check_equiv.py DEVICE OUT_DIR [P ...]
(benchmarks/gpu_check.sh runs it).

Cases: float64 (exact, 1e-9), float32 (1e-4), bf16 autocast (against plain autograd under the same autocast, to
3e-2, with the float32 reference's distance from that autograd beside it as the yardstick: on CUDA dropout draws
other masks for bf16 tensors than for float32 ones, so with dropout the float32 reference is another function); B =
C (one forward) and B < C (a recompute, dropout 0.3: the CUDA generator replayed); InfoNCE gathered and ring, the
sigmoid loss gathered and ring; a learned scale; strict device mode on. Then the loss machinery on real tiles (N =
4096, d = 256) against autograd's dL/dZ. Prints one line per case and writes equivalence.json to OUT."""

import copy
import json
import os
import sys
import time

import torch
from streamed_helpers import DROPOUT_SEED, SigTowers, Towers, full_batch, rank_streams
from torch.nn.parallel import DistributedDataParallel as DDP

from distlab.contrastive.losses import clip_loss
from distlab.processes.spawn import spawn
from distlab.proof.compare import grads_of
from distlab.proof.models import paired_data
from distlab.streamed import loss_machinery
from distributed_clip import distributed_backward

N = 96  # divisible by P = 1, 2, 4, 8; the recompute cases take B = C / 2


def rel(a, b):
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def whole_rel(got: dict, ref: dict) -> float:
    names = sorted(ref)
    g = torch.cat([got[n].detach().double().cpu().flatten() for n in names])
    r = torch.cat([ref[n].detach().double().cpu().flatten() for n in names])
    return ((g - r).norm() / r.norm()).item()


def build(case, dtype):
    kw = dict(dropout=case["dropout"], dtype=dtype)
    if case["loss"] == "sigmoid":
        return SigTowers(**kw)
    return Towers(scale_shape=() if case["scale"] else None, **kw)


def one_case(rt, case):
    dev = rt.device
    dtype = {"float64": torch.float64, "float32": torch.float32, "bf16": torch.float32}[case["dtype"]]
    base = build(case, dtype)
    x, y = (t.to(device=dev, dtype=dtype) for t in paired_data(N, seed=3, dtype=torch.float64))
    world, c = rt.world_size, N // rt.world_size
    mine = slice(rt.rank * c, (rt.rank + 1) * c)
    b = max(1, c // 2) if case["b"] == "half" else case["b"]
    config = {
        "GLOBAL_BATCH_SIZE": N,
        "MICRO_BATCH_SIZE": b,
        "STREAM_CHUNK_SIZE": case["t"],
        "EXCHANGE": case["exchange"],
    }
    tau = None if (case["scale"] or case["loss"] == "sigmoid") else 0.1
    if tau is not None:
        config["TAU"] = tau
    # the reference: a deep copy, the whole batch, plain autograd, this rank's dropout stream replayed
    ref_model = copy.deepcopy(base).to(dev)
    streams = rank_streams(world, DROPOUT_SEED) if case["dropout"] else None
    loss_ref = full_batch(ref_model, x, y, world, b, tau, streams)
    loss_ref.backward()
    ref = grads_of(ref_model)
    out = {}
    if case["dtype"] == "bf16":  # the reference: plain autograd under the same autocast (the same masks)
        am = copy.deepcopy(base).to(dev)
        streams = rank_streams(world, DROPOUT_SEED) if case["dropout"] else None
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            la = full_batch(am, x, y, world, b, tau, streams)
        la.float().backward()
        f32, ref = ref, grads_of(am)
        out["yardstick_f32_vs_autocast"] = whole_rel(f32, ref)
    model = copy.deepcopy(base).to(dev)
    ddp = DDP(model, device_ids=[dev.index] if dev.type == "cuda" else None)
    torch.manual_seed(DROPOUT_SEED + rt.rank)
    ctx = (
        torch.autocast(dev.type, dtype=torch.bfloat16)
        if case["dtype"] == "bf16"
        else torch.autocast(dev.type, enabled=False)
    )
    if case.get("strict"):
        from distlab.processes.strict import strict_device

        with strict_device(rt):
            with ctx:
                loss = distributed_backward(ddp, x[mine], y[mine], config)
    else:
        with ctx:
            loss = distributed_backward(ddp, x[mine], y[mine], config)
    got = grads_of(model)
    out.update(
        rel=whole_rel(got, ref),
        loss=loss,
        loss_ref=loss_ref.item(),
        worst_tensor=max(rel(got[n], ref[n]) for n in ref),
        grad_devices=sorted({str(model.get_parameter(n).grad.device) for n in ref}),
    )
    if case["dtype"] == "bf16":
        out.update(loss_ref=la.item(), rel_f32=whole_rel(got, f32))  # (the step's distance from float32 too)
    return out


def tiles_case(rt, n, d, t, dtype):
    """loss_machinery on real tiles against autograd's dL/dZ of clip_loss (C = N at P = 1)."""
    gen = torch.Generator().manual_seed(7)
    z_x = torch.nn.functional.normalize(torch.randn(n, d, generator=gen), dim=1)
    z_y = torch.nn.functional.normalize(z_x + torch.randn(n, d, generator=gen), dim=1)
    z_x, z_y = z_x.to(rt.device, dtype), z_y.to(rt.device, dtype)
    cfg = {"GLOBAL_BATCH_SIZE": n, "MICRO_BATCH_SIZE": n, "STREAM_CHUNK_SIZE": t, "TAU": 0.07}
    loss, g_x, g_y = loss_machinery(z_x, z_y, cfg)
    rx, ry = z_x.double().clone().requires_grad_(), z_y.double().clone().requires_grad_()
    lref = clip_loss(rx, ry, 1 / 0.07)
    lref.backward()
    return dict(rel_gx=rel(g_x, rx.grad), rel_gy=rel(g_y, ry.grad), loss=loss, loss_ref=lref.item())


TOLERANCES = {"float64": 1e-9, "float32": 1e-4, "bf16": 3e-2}  # relative error allowed against autograd
BASE = dict(dtype="float64", loss="infonce", exchange="gather", b="half", t=7, dropout=0.3, scale=True)
WHOLE = dict(b=N, t=16, dropout=0.0)  # B = C: one micro-batch a rank, nothing recomputed, no dropout


def case(name: str, **changes) -> dict:
    """One case: BASE (micro-batches of C / 2 with dropout, a learned scale, T = 7) with `changes`, allowed the
    tolerance of its dtype."""
    spec = BASE | changes
    return spec | {"name": name, "tol": TOLERANCES[spec["dtype"]]}


CASES = [
    *(
        each
        for dtype in TOLERANCES
        for each in (
            case(f"{dtype} InfoNCE gather B=C tau", dtype=dtype, scale=False, **WHOLE),
            case(f"{dtype} InfoNCE gather B<C dropout learned-s", dtype=dtype),
        )
    ),
    case("float64 InfoNCE ring B<C dropout", exchange="ring"),
    case("float64 sigmoid gather B<C dropout", loss="sigmoid"),
    case("float64 sigmoid ring B=C", loss="sigmoid", exchange="ring", **WHOLE),
    case("float32 InfoNCE gather B<C dropout, strict device mode", dtype="float32", strict=True),
]


def every_case(rt, big):
    res = []
    for case in CASES:
        t0 = time.perf_counter()
        try:
            r = one_case(rt, case)
            r["ok"] = r["rel"] <= case["tol"]
        except Exception as err:  # noqa: BLE001 - reported, the next case runs
            r = {"ok": False, "error": f"{type(err).__name__}: {err}"[:400]}
        r.update(name=case["name"], tol=case["tol"], seconds=time.perf_counter() - t0)
        res.append(r)
    for n, d, t, dt, tol in big:
        t0 = time.perf_counter()
        name = f"loss_machinery N={n} d={d} T={t} {str(dt).split('.')[-1]} vs autograd dL/dZ"
        try:
            r = tiles_case(rt, n, d, t, dt)
            r["ok"] = max(r["rel_gx"], r["rel_gy"]) <= tol
        except Exception as err:  # noqa: BLE001
            r = {"ok": False, "error": f"{type(err).__name__}: {err}"[:400]}
        r.update(name=name, tol=tol, seconds=time.perf_counter() - t0)
        res.append(r)
    return dict(
        device=str(rt.device),
        backend=rt.backend,
        torch=torch.__version__,
        name=torch.cuda.get_device_name(rt.device) if rt.device.type == "cuda" else "cpu",
        cases=res,
    )


def main():
    device, out = sys.argv[1], sys.argv[2]
    worlds = [int(p) for p in sys.argv[3:]] or [1]
    everything, ok = {}, True
    for world in worlds:
        big = []
        if world == 1:
            big = [(4096, 256, 512, torch.float32, 1e-4), (4096, 256, 512, torch.float64, 1e-10)]
            if device == "cpu":
                big = [(512, 64, 128, torch.float32, 1e-4)]
        t0 = time.perf_counter()
        ranks = spawn(every_case, world, big, device=device, timeout_s=60, limit_s=240)
        result = ranks[0]
        # every rank checks its own gradients (DDP reduced them) against its own copy of the reference
        for k, r in enumerate(result["cases"]):
            r["ok"] = all(rr["cases"][k]["ok"] for rr in ranks)
            if "rel" in r:
                r["worst_rank_rel"] = max(rr["cases"][k].get("rel", float("inf")) for rr in ranks)
        result["wall_s"] = time.perf_counter() - t0
        print(
            f"P = {world}: device {result['device']} ({result['name']}), backend {result['backend']}, "
            f"torch {result['torch']}"
        )
        for r in result["cases"]:
            status = "PASS" if r["ok"] else "FAIL"
            detail = r.get("error") or ", ".join(
                f"{k} {v:.2e}" if isinstance(v, float) else f"{k} {v}"
                for k, v in r.items()
                if k not in ("name", "ok", "tol", "seconds")
            )
            print(f"  {status}  P={world}  {r['name']}  (tol {r['tol']:.0e}; {r['seconds']:.1f} s): {detail}")
        everything[f"P={world}"] = result
        ok = ok and all(r["ok"] for r in result["cases"])
    name = "equivalence.json" if worlds == [1] else "equivalence_ranks.json"
    with open(os.path.join(out, name), "w") as f:
        json.dump(everything, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
