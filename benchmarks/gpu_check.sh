#!/usr/bin/env bash
# distlab on one GPU: install, then (a) the library's step at P = 1 on cuda against plain autograd,
# (b) the multi-rank tests on CPU/gloo (GPU hidden) and the step at P = 2, 4, 8 on CPU/gloo against plain
# autograd, lesson 25 at P = 8; (c) every lesson at P = 1 with --device cuda (every one expected to pass),
# (d) time and memory of the streamed loss machinery against ClipLoss's C x N logits, (e) the peers
# (benchmarks/peers_gpu.py: open_clip, memeff, siglip-kernel at P = 1) and the kernels' benchmark
# (benchmarks/kernels_gpu.py, when the checkout has it).
#
#   bash benchmarks/gpu_check.sh --steps acde --budget 270      # on a lent GPU: one call of under 6 min
#   bash benchmarks/gpu_check.sh --cpu-dry-run                  # here, before a GPU is spent (5-7 min)
#
# --cpu-dry-run  everything on the CPU with small sizes, lessons in strict device mode (cpu:0 stands in for
#                the GPU: a tensor left on the host fails as on a GPU)
# --out DIR      where the results go (default: $OUT, else ./gpu_check_out); 10 files at most
# --repo DIR     the distlab checkout (default: the current directory)
# --python PY    the interpreter (default: python3); a CUDA torch is used as it is, else torch==2.13.0 is installed
# --quick        (d) at N = 8192 and 32768 only
# --steps abcde  which of (a)-(e) to run (default: all five), e.g. --steps d to rerun the timing alone
# --budget S     the whole check's seconds (default 470): each step's timeout is cut so that the steps after
#                it keep their share, and (d), then (e), get what is left
# The peers travel as wheels in the ignored folder .whl/ (`pip download --no-deps open-clip-torch memeff
# siglip-kernel -d .whl` where a registry is reachable; the device call carries it: carry [".whl"]); they
# are installed with `pip install --no-index --no-deps --target /tmp/site` and found on PYTHONPATH.
# What one GPU cannot show: NCCL puts one rank per GPU, so nothing here runs nccl with P >= 2 (no multi-rank
# nccl collectives, batch_isend_irecv, ring overlap, dead-peer naming or checkpoint barriers under nccl).
set -u
MODE=gpu; OUTDIR=${OUT:-./gpu_check_out}; REPO=$PWD; PY=python3; QUICK=0; STEPS=abcde; BUDGET=470
while [ $# -gt 0 ]; do
  case "$1" in
    --cpu-dry-run) MODE=cpu ;;
    --out) OUTDIR=$2; shift ;;
    --repo) REPO=$2; shift ;;
    --python) PY=$2; shift ;;
    --quick) QUICK=1 ;;
    --steps) STEPS=$2; shift ;;
    --budget) BUDGET=$2; shift ;;
    *) echo "unknown argument $1"; exit 2 ;;
  esac
  shift
done
REPO=$(cd "$REPO" && pwd); mkdir -p "$OUTDIR"; OUTDIR=$(cd "$OUTDIR" && pwd)
[ -d "$REPO/src/distlab" ] || { echo "no distlab checkout at $REPO (use --repo)"; exit 2; }
cd "$REPO"
T0=$SECONDS
ENV_LOG=$OUTDIR/env.txt; SUMMARY=$OUTDIR/summary.md
HELP=$(mktemp -d); trap 'rm -rf "$HELP"' EXIT
export PYTHONPATH="$REPO/src:$REPO/tests:$REPO/benchmarks${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 COLUMNS=120
export OMP_NUM_THREADS=1 DISTLAB_TIMEOUT_S=60
say() { echo "[$((SECONDS - T0)) s] $*" | tee -a "$ENV_LOG"; }
: > "$ENV_LOG"
say "mode $MODE, repo $REPO, out $OUTDIR"
{ date -u; uname -a; echo "cores: $(nproc --all)"; nvidia-smi -L 2>&1 | head -4; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | head -3; } >> "$ENV_LOG" 2>&1

# --- install -------------------------------------------------------------------------------------------
probe() { "$PY" - <<'PY' 2>/dev/null
import torch
print(torch.__version__, torch.version.cuda, torch.cuda.is_available(), torch.cuda.device_count())
PY
}
if [ "$MODE" = gpu ]; then
  read -r TV TCUDA TAVAIL TCOUNT <<< "$(probe)"
  if [ "${TAVAIL:-}" != True ]; then
    say "no CUDA torch in $PY (got: ${TV:-none}); installing torch==2.13.0 from PyPI into a venv (a CUDA 13.0 build: torch 527 MB + nvidia-* wheels, ~5.5 GB installed)"
    "$PY" -m venv "$HELP/venv" && PY=$HELP/venv/bin/python
    start=$SECONDS
    if ! timeout 420 "$PY" -m pip install -q torch==2.13.0 rich==15.0.0 numpy==2.4.6 pytest==9.2.0 pytest-timeout==2.4.0 \
         scikit-learn==1.9.1 matplotlib==3.11.2 pytest-xdist >> "$ENV_LOG" 2>&1; then
      say "FAIL: pip could not install torch==2.13.0 (no route to PyPI?): see env.txt"; exit 3
    fi
    say "pip install took $((SECONDS - start)) s"
    read -r TV TCUDA TAVAIL TCOUNT <<< "$(probe)"
  fi
  [ "${TAVAIL:-}" = True ] || { say "FAIL: torch ${TV:-?} sees no GPU"; exit 3; }
  DEV=cuda
  [ "${TV%%+*}" = 2.13.0 ] || say "NOTE: torch $TV, not the pinned 2.13.0: a failure below may be the version, not the GPU"
else
  read -r TV TCUDA TAVAIL TCOUNT <<< "$(probe)"
  [ -n "${TV:-}" ] || { echo "no torch in $PY"; exit 3; }
  DEV=cpu
fi
say "python $("$PY" -c 'import sys; print(sys.version.split()[0])'), torch $TV (CUDA ${TCUDA}), device $DEV, GPUs $TCOUNT"
MISSING=$("$PY" - <<'PY'
import importlib.util
print(" ".join(m for m in ("rich", "numpy", "pytest", "pytest_timeout", "sklearn", "matplotlib") if importlib.util.find_spec(m) is None))
PY
)
if [ -n "$MISSING" ]; then
  say "missing: $MISSING; trying pip (pinned versions)"
  timeout 240 "$PY" -m pip install -q rich==15.0.0 numpy==2.4.6 pytest==9.2.0 pytest-timeout==2.4.0 scikit-learn==1.9.1 \
    matplotlib==3.11.2 >> "$ENV_LOG" 2>&1 || say "pip could not install them; the steps that need them will fail"
fi
XDIST=""; CORES=$(nproc --all); "$PY" -c "import xdist" 2>/dev/null && [ "$CORES" -ge 8 ] && XDIST="-n $((CORES / 4))"
# The torch.distributed names the project calls: any the installed torch lacks is listed (a torch older than the
# pinned 2.13.0, as on an image that cannot reach PyPI). The gathers torch 2.11 names otherwise
# (all_gather_single, reduce_scatter_single, the functional all_gather_single_autograd) go through
# distlab.processes.compat, which takes whichever name the installed torch has; the list says so.
API=$("$PY" - <<'PY'
import importlib, torch.distributed as dist, torch.distributed._functional_collectives as funcol
names = ("all_reduce get_world_size get_rank isend ReduceOp irecv batch_isend_irecv barrier group "
         "all_gather_object all_gather recv get_process_group_ranks send is_initialized "
         "init_process_group get_global_rank destroy_process_group Work reduce_scatter is_available broadcast_object_list "
         "broadcast TCPStore Store ProcessGroup PrefixStore HashStore GroupMember GradBucket DistError").split()
missing = [n for n in names if not hasattr(dist, n)]
missing += [f"{n} (distlab.processes.compat: {old})" for n, old in (("all_gather_single", "all_gather_into_tensor"),
            ("reduce_scatter_single", "reduce_scatter_tensor")) if not hasattr(dist, n)]
if not hasattr(funcol, "all_gather_single_autograd"):
    missing.append("_functional_collectives.all_gather_single_autograd (distlab.processes.compat: all_gather_tensor_autograd)")
for mod, attr in (("torch.distributed.fsdp", "fully_shard"), ("torch.distributed.fsdp", "FSDPModule"),
                  ("torch.distributed.pipelining", "ScheduleZBVZeroBubble"), ("torch.distributed.checkpoint", "save")):
    try:
        if not hasattr(importlib.import_module(mod), attr):
            missing.append(f"{mod}.{attr}")
    except Exception as err:
        missing.append(f"{mod} ({type(err).__name__})")
print("; ".join(missing))
PY
)
[ -n "$API" ] && say "NOTE: this torch lacks what the project calls: $API"
COMPAT=""; case "$API" in *distlab.processes.compat*) COMPAT=" (2.11's collective names, through distlab.processes.compat)" ;; esac
# The peers, as wheels carried in .whl/ (no network here): installed into a folder of their own, last on the path.
SITE=/tmp/site; [ "$MODE" = cpu ] && SITE=$HELP/site
PEERS="no .whl/ folder: the peers were not carried"
if ls "$REPO"/.whl/*.whl > /dev/null 2>&1; then
  if "$PY" -m pip install -q --no-index --no-deps --target "$SITE" "$REPO"/.whl/*.whl >> "$ENV_LOG" 2>&1; then
    export PYTHONPATH="$PYTHONPATH:$SITE"; PEERS="installed from .whl/: $(cd "$REPO/.whl" && ls *.whl | tr '\n' ' ')"
  else
    PEERS="pip could not install .whl/ (see env.txt)"
  fi
fi
say "peers: $PEERS"
"$PY" -c "import distlab, distributed_clip" || { say "FAIL: distlab does not import"; exit 3; }

# --- the helpers (written here so that this script is the one file to carry) ---------------------------
cat > "$HELP/gpu_equiv.py" <<'PYEOF'
"""The library's step at P ranks on DEVICE against plain autograd on the whole batch, under spawn (torchrun's
environment, distlab.processes.runtime.distributed(DEVICE): on a GPU the group is cpu:gloo,cuda:nccl). (a) runs it at
P = 1 on cuda; (b) at P = 2, 4, 8 on the CPU (gloo). Usage: gpu_equiv.py DEVICE OUT_DIR [P ...]

Cases: float64 (exact, 1e-9), float32 (1e-4), bf16 autocast (against plain autograd under the same autocast,
to 3e-2, with the float32 reference's distance from that autograd beside it as the yardstick: on CUDA dropout
draws other masks for bf16 tensors than for float32 ones, so with dropout the float32 reference is another
function); B = C (one forward) and B < C (a recompute, dropout 0.3: the CUDA generator replayed); InfoNCE gathered and ring, the sigmoid loss gathered and
ring; a learned scale; strict device mode on. Then the loss machinery on real tiles (N = 4096, d = 256)
against autograd's dL/dZ. Prints one line per case and writes equivalence.json to OUT."""
import copy, json, math, os, sys, time

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from distlab.proof.compare import grads_of
from distlab.contrastive.losses import clip_loss
from distlab.proof.models import paired_data
from distlab.processes.spawn import spawn
from distlab.streamed import loss_machinery
from distributed_clip import distributed_backward
from streamed_helpers import DROPOUT_SEED, SigTowers, Towers, full_batch, rank_streams

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
    config = {"GLOBAL_BATCH_SIZE": N, "MICRO_BATCH_SIZE": b, "STREAM_CHUNK_SIZE": case["t"],
              "EXCHANGE": case["exchange"]}
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
    ctx = torch.autocast(dev.type, dtype=torch.bfloat16) if case["dtype"] == "bf16" else torch.autocast(dev.type, enabled=False)
    if case.get("strict"):
        from distlab.processes.strict import strict_device
        with strict_device(rt):
            with ctx:
                loss = distributed_backward(ddp, x[mine], y[mine], config)
    else:
        with ctx:
            loss = distributed_backward(ddp, x[mine], y[mine], config)
    got = grads_of(model)
    out.update(rel=whole_rel(got, ref), loss=loss, loss_ref=loss_ref.item(),
               worst_tensor=max(rel(got[n], ref[n]) for n in ref),
               grad_devices=sorted({str(model.get_parameter(n).grad.device) for n in ref}))
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


CASES = []
for dtype, tol in (("float64", 1e-9), ("float32", 1e-4), ("bf16", 3e-2)):
    CASES += [
        dict(name=f"{dtype} InfoNCE gather B=C tau", dtype=dtype, tol=tol, loss="infonce", exchange="gather", b=N, t=16, dropout=0.0, scale=False),
        dict(name=f"{dtype} InfoNCE gather B<C dropout learned-s", dtype=dtype, tol=tol, loss="infonce", exchange="gather", b="half", t=7, dropout=0.3, scale=True),
    ]
CASES += [
    dict(name="float64 InfoNCE ring B<C dropout", dtype="float64", tol=1e-9, loss="infonce", exchange="ring", b="half", t=7, dropout=0.3, scale=True),
    dict(name="float64 sigmoid gather B<C dropout", dtype="float64", tol=1e-9, loss="sigmoid", exchange="gather", b="half", t=7, dropout=0.3, scale=True),
    dict(name="float64 sigmoid ring B=C", dtype="float64", tol=1e-9, loss="sigmoid", exchange="ring", b=N, t=16, dropout=0.0, scale=True),
    dict(name="float32 InfoNCE gather B<C dropout, strict device mode", dtype="float32", tol=1e-4, loss="infonce", exchange="gather", b="half", t=7, dropout=0.3, scale=True, strict=True),
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
    for (n, d, t, dt, tol) in big:
        t0 = time.perf_counter()
        name = f"loss_machinery N={n} d={d} T={t} {str(dt).split('.')[-1]} vs autograd dL/dZ"
        try:
            r = tiles_case(rt, n, d, t, dt)
            r["ok"] = max(r["rel_gx"], r["rel_gy"]) <= tol
        except Exception as err:  # noqa: BLE001
            r = {"ok": False, "error": f"{type(err).__name__}: {err}"[:400]}
        r.update(name=name, tol=tol, seconds=time.perf_counter() - t0)
        res.append(r)
    return dict(device=str(rt.device), backend=rt.backend, torch=torch.__version__,
                name=torch.cuda.get_device_name(rt.device) if rt.device.type == "cuda" else "cpu", cases=res)


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
        print(f"P = {world}: device {result['device']} ({result['name']}), backend {result['backend']}, torch {result['torch']}")
        for r in result["cases"]:
            status = "PASS" if r["ok"] else "FAIL"
            detail = r.get("error") or ", ".join(f"{k} {v:.2e}" if isinstance(v, float) else f"{k} {v}"
                                                  for k, v in r.items() if k not in ("name", "ok", "tol", "seconds"))
            print(f"  {status}  P={world}  {r['name']}  (tol {r['tol']:.0e}; {r['seconds']:.1f} s): {detail}")
        everything[f"P={world}"] = result
        ok = ok and all(r["ok"] for r in result["cases"])
    name = "equivalence.json" if worlds == [1] else "equivalence_ranks.json"
    with open(os.path.join(out, name), "w") as f:
        json.dump(everything, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
PYEOF
cat > "$HELP/gpu_timing.py" <<'PYEOF'
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
Usage: gpu_timing.py DEVICE OUT_DIR [--sizes N ...] [--dim d] [--repeats R]"""
import argparse, json, math, os, statistics, sys, time
from collections import Counter

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from distlab.contrastive.losses import clip_loss, local_clip_loss
from distlab.processes.spawn import spawn
from distlab.streamed import loss_machinery
from distlab.streamed.tiles import streamed_lse, streamed_softmax_pair_product
from distlab.pieces.chunks import chunks

TAU = 0.07
NO_KERNEL = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach", "lift_fresh",
             "alias", "_local_scalar_dense", "set_"}
OPS_PER_CELL = 37.5    # launching ops per T x T cell of the C x N grid (phase 2: 2 x 11.3, phase 3: 2 x 7.4), counted on CPU
LAUNCH_BUDGET = 400_000


class Launches(TorchDispatchMode):
    def __init__(self):
        super().__init__(); self.n = 0
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
    a, b = a_own.repeat(reps), b_own.repeat(reps)          # stand-ins for the other ranks' a, b (shapes only)
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
        torch.mm(q_x[r], k_y[k].T); torch.mm(q_y[r], k_x[k].T)
    for r, k in tiles:
        g_x[r].addmm_(torch.mm(q_x[r], k_y[k].T), k_y[k]); g_y[r].addmm_(torch.mm(q_y[r], k_x[k].T), k_x[k])
    return g_x, g_y


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def measure(fn, dev, repeats):
    """(median seconds, peak bytes above the start, launching ops) or raises (OOM)."""
    sync(dev)
    if dev.type == "cuda":
        torch.cuda.empty_cache(); torch.cuda.reset_peak_memory_stats(dev)
    base = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0
    with Launches() as count:
        out = fn()
    del out
    sync(dev)
    peak = torch.cuda.max_memory_allocated(dev) - base if dev.type == "cuda" else float("nan")
    times = []
    for _ in range(repeats):
        sync(dev); t0 = time.perf_counter(); out = fn(); sync(dev); times.append(time.perf_counter() - t0); del out
    return statistics.median(times), peak, count.n


def rank_fn(rt, sizes, dim, repeats, ts):
    dev = rt.device
    rows = []
    info = dict(device=str(dev), name=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                torch=torch.__version__, backend=rt.backend, dim=dim, repeats=repeats,
                allow_tf32_default=torch.backends.cuda.matmul.allow_tf32)
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
                fn = (lambda t=t: streamed_p1(z_x, z_y, t)) if c == n else (lambda t=t, c=c: streamed_rank(z_x, z_y, c, t))
                calls.append((setting, label, fn, None))
                if t == max(ts):  # the same with TF32 tensor cores for the float32 tile matmuls
                    calls.append((setting, label + ", TF32 on", ("tf32", fn), None))
            for bf16 in (False, True):
                fn = (lambda b=bf16: clip_p1(z_x, z_y, b)) if c == n else (lambda b=bf16, c=c: clip_rank(z_x, z_y, c, b))
                calls.append((setting, f"ClipLoss {'C x N' if c < n else 'N x N'} logits, {'bf16 autocast' if bf16 else 'float32'}", fn, None))
            t = max(ts)
            for dt in (torch.float32, torch.bfloat16):
                calls.append((setting, f"6 C N d floor, mm in T = {t} tiles, {str(dt).split('.')[-1]}",
                              lambda c=c, t=t, dt=dt: floor(z_x, z_y, c, t, dt), None))
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
    lines = [f"device {info['name']} ({info['device']}), torch {info['torch']}, {info['backend']}, d = {info['dim']}, "
             f"median of {info['repeats']} after a warm-up; memory = max_memory_allocated above the start; "
             f"TFLOP/s counts 6 C N d multiply-adds (2 flops each) whatever the method does; "
             f"launches = torch ops that start a kernel, counted in the warm-up. TF32 default: {info['allow_tf32_default']}.", "",
             "| N | setting | method | seconds | x ClipLoss bf16 | peak GiB | launches | TFLOP/s (6 C N d) | note |",
             "|---:|---|---|---:|---:|---:|---:|---:|---|"]
    for r in result["rows"]:
        base = next((b for b in result["rows"] if b["n"] == r["n"] and b["setting"] == r["setting"]
                     and b["method"].startswith("ClipLoss") and "bf16" in b["method"] and "seconds" in b), None)
        if "seconds" in r:
            ratio = f"{r['seconds'] / base['seconds']:.2f}" if base else "-"
            gib = f"{r['peak_bytes'] / 2**30:.2f}" if r["peak_bytes"] == r["peak_bytes"] else "-"
            lines.append(f"| {r['n']} | {r['setting']} | {r['method']} | {r['seconds']:.4f} | {ratio} | {gib} | "
                         f"{r['launches']:,} | {r['tflops']:.1f} | |")
        else:
            lines.append(f"| {r['n']} | {r['setting']} | {r['method']} | - | - | - | - | - | {r['note']} |")
    return "\n".join(lines) + "\n"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("device"); p.add_argument("out")
    p.add_argument("--sizes", type=int, nargs="+", default=[8192, 32768, 65536])
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--chunks", type=int, nargs="+", default=[1024, 4096], help="T values for the streamed rows")
    p.add_argument("--limit-s", type=float, default=300)
    a = p.parse_args()
    result = spawn(rank_fn, 1, a.sizes, a.dim, a.repeats, a.chunks, device=a.device, timeout_s=120, limit_s=a.limit_s)[0]
    text = table(result)
    print(text)
    with open(os.path.join(a.out, "timing.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(a.out, "timing.md"), "w") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
PYEOF

# --- (a) equivalence at P = 1 on the device -------------------------------------------------------------
# Each step's share of --budget (seconds): (a) a sixth, each lesson of (c) two fifths (they run side by side),
# (d) half of what is left after (c), (e) the rest. On the CPU the dry run's fixed sizes set the time.
A_CAP=$((BUDGET / 6)); [ "$A_CAP" -gt 240 ] && A_CAP=240; [ "$MODE" = cpu ] && A_CAP=240
say "(a) the step at P = 1 on $DEV against plain autograd (at most $A_CAP s)"
start=$SECONDS; RC_A=0; : > "$HELP/equiv.log"
if [[ $STEPS == *a* ]]; then timeout -k 10 "$A_CAP" "$PY" "$HELP/gpu_equiv.py" "$DEV" "$OUTDIR" > "$HELP/equiv.log" 2>&1; RC_A=$?; fi
cat "$HELP/equiv.log" >> "$ENV_LOG"; grep -E "PASS|FAIL|device|Error" "$HELP/equiv.log" | head -30
T_A=$((SECONDS - start))

# --- (b) multi-rank tests on CPU/gloo, GPU hidden (in the background, beside (c)) ----------------------
TESTS="tests/test_streamed.py tests/test_streamed_step.py tests/test_streamed_wrappers.py tests/test_streamed_guards.py
 tests/test_streamed_ring_wrappers.py tests/test_streamed_sigmoid_ring.py tests/test_streamed_sigmoid_ring_step.py
 tests/test_streamed_accum_freq.py tests/test_streamed_open_clip.py tests/test_streamed_readme.py tests/test_strict_device.py
 tests/test_strict_device_ranks.py tests/test_device_cuda_dry_run.py tests/test_runtime.py tests/test_losses_and_gathers.py
 tests/test_memory_and_rng.py tests/test_grad_cache.py tests/test_context_parallel.py"
[ "$MODE" = cpu ] && TESTS="tests/test_runtime.py tests/test_streamed_readme.py tests/test_strict_device.py"
say "(b) multi-rank tests on CPU/gloo (P = 1-4 ranks per test${XDIST:+, pytest $XDIST}), CUDA_VISIBLE_DEVICES empty"
start_b=$SECONDS
# shellcheck disable=SC2086
[[ $STEPS == *b* ]] || echo 0 > "$HELP/rc_b"
[[ $STEPS == *b* ]] && ( CUDA_VISIBLE_DEVICES= timeout -k 10 330 "$PY" -m pytest -q -p no:cacheprovider $XDIST -o addopts="-ra" $TESTS \
    > "$OUTDIR/pytest_cpu.log" 2>&1; echo $? > "$HELP/rc_b" ) &
PID_B=$!; [[ $STEPS == *b* ]] && touch "$OUTDIR/pytest_cpu.log"
# (b2) beside it: the library's step at P = 2, 4, 8 on CPU/gloo against plain autograd (the cases of (a)),
# then lesson 25 at P = 8 (gloo)
[[ $STEPS == *b* ]] || echo 0 > "$HELP/rc_b2"
[[ $STEPS == *b* ]] && ( export CUDA_VISIBLE_DEVICES=; timeout -k 10 240 "$PY" "$HELP/gpu_equiv.py" cpu "$OUTDIR" 2 4 8 > "$HELP/ranks.log" 2>&1
    rc=$?
    timeout -k 10 240 "$PY" -m torch.distributed.run --standalone --nproc-per-node 8 lessons/25_streamed_five_phase.py \
      --device cpu > "$HELP/lesson14_p8.log" 2>&1 || rc=$((rc + 100))
    echo $rc > "$HELP/rc_b2" ) &
PID_B2=$!

# --- (c) every lesson at P = 1 with --device $DEV, side by side; every one is expected to pass ----------------
mkdir -p "$HELP/lessons"
C_CAP=$((BUDGET * 2 / 5)); [ "$C_CAP" -gt 150 ] && C_CAP=150; [ "$MODE" = cpu ] && C_CAP=150
JOBS=3; [ "$CORES" -ge 12 ] && JOBS=6
# On the CPU the lessons run in strict device mode: cpu:0 stands in for cuda:0, and a tensor left on the host
# fails as it would on a GPU (lessons 25 and 26 were caught so before their first GPU run was read).
[ "$MODE" = cpu ] && export DISTLAB_STRICT_DEVICE=1
run_lesson() {  # lesson file -> one line: name rc seconds verdict
  local f=$1 name; name=$(basename "$f" .py); local s=$SECONDS
  timeout -k 10 "$C_CAP" "$PY" -m torch.distributed.run --standalone --nproc-per-node 1 "$f" --device "$DEV" \
    --json "$HELP/lessons/$name.json" > "$HELP/lessons/$name.log" 2>&1
  local rc=$?
  local verdict; verdict=$(grep -E "PASS: every claim|FAIL: [0-9]+ of|^error:|Error:" "$HELP/lessons/$name.log" | tail -1 | cut -c1-150)
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - s))" "$verdict"
}
export -f run_lesson; export HELP DEV PY C_CAP
LESSON_FILES=$(ls lessons/[0-9][0-9]_*.py)
[ "$MODE" = cpu ] && LESSON_FILES="lessons/02_gpipe_checkpoint.py lessons/03_one_f_one_b.py
 lessons/23_contrastive_allgather_fix.py lessons/25_streamed_five_phase.py"
[[ $STEPS == *c* ]] || LESSON_FILES=""
say "(c) lessons at P = 1 with --device $DEV, $JOBS at a time, at most $C_CAP s each"
start=$SECONDS
# shellcheck disable=SC2086
printf '%s\n' $LESSON_FILES | grep . | xargs -r -P "$JOBS" -I{} bash -c 'run_lesson {}' | sort > "$HELP/lessons.tsv"
unset DISTLAB_STRICT_DEVICE
T_C=$((SECONDS - start)); RC_C=$(awk -F'\t' '$2!=0' "$HELP/lessons.tsv" | wc -l)
{ echo "# lessons at P = 1, --device $DEV: name, exit code, seconds, verdict line"; cat "$HELP/lessons.tsv"; echo;
  for f in "$HELP"/lessons/*.log; do echo "=== $(basename "$f")"; grep -E "PASS|FAIL|error|Error|Traceback" "$f" | head -40; done;
  for f in "$HELP"/lessons/*.log; do echo; echo "=== full log: $(basename "$f")"; tail -c 6000 "$f"; done; } > "$OUTDIR/lessons.log"
cat "$HELP/lessons.tsv"

say "waiting for (b)"
wait $PID_B; RC_B=$(cat "$HELP/rc_b" 2>/dev/null || echo 99)
wait $PID_B2; RC_B2=$(cat "$HELP/rc_b2" 2>/dev/null || echo 99); T_B=$((SECONDS - start_b))
tail -3 "$OUTDIR/pytest_cpu.log"; grep -E "^P = |FAIL" "$HELP/ranks.log" 2>/dev/null | head -20
{ echo; echo "=== lesson 25 at P = 8 on CPU/gloo"; grep -E "PASS|FAIL|rror" "$HELP/lesson14_p8.log" 2>/dev/null | head -20
  echo; echo "=== the step at P = 2, 4, 8 on CPU/gloo"; cat "$HELP/ranks.log" 2>/dev/null; } >> "$OUTDIR/lessons.log"

# --- (d) timing: streamed loss machinery vs ClipLoss ----------------------------------------------------
if [ "$MODE" = cpu ]; then SIZES="512 1024"; DIMARGS="--dim 64 --chunks 128 512 --repeats 1"
elif [ "$QUICK" = 1 ]; then SIZES="8192 32768"; DIMARGS="--dim 1024 --chunks 1024 4096 --repeats 3"
else SIZES="8192 32768 65536"; DIMARGS="--dim 1024 --chunks 1024 4096 --repeats 3"; fi
LEFT=$(((BUDGET - (SECONDS - T0)) / 2))   # within the budget: (d) gets half of what is left, (e) the rest
[[ $STEPS == *e* ]] || LEFT=$((BUDGET - (SECONDS - T0)))
if [ "$MODE" = gpu ] && [ "$LEFT" -lt 100 ]; then SIZES="8192 32768"; say "(d) shortened to N = $SIZES: $LEFT s for it"; fi
[ "$LEFT" -lt 45 ] && LEFT=45
[ "$MODE" = cpu ] && LEFT=300
say "(d) timing at N = $SIZES ($DIMARGS)"
start=$SECONDS
# shellcheck disable=SC2086
RC_D=0; : > "$HELP/timing.log"
if [[ $STEPS == *d* ]]; then
  timeout -k 10 "$LEFT" "$PY" "$HELP/gpu_timing.py" "$DEV" "$OUTDIR" --sizes $SIZES $DIMARGS --limit-s $((LEFT - 10)) > "$HELP/timing.log" 2>&1; RC_D=$?
fi
T_D=$((SECONDS - start))
cat "$HELP/timing.log" >> "$ENV_LOG"
[ -f "$OUTDIR/timing.md" ] && cat "$OUTDIR/timing.md" || tail -20 "$HELP/timing.log"

# --- (e) the peers, and the kernels' own benchmark when the checkout has it ------------------------------
# peers_gpu.py: distlab's loss machinery against open_clip, memeff and siglip-kernel at P = 1 (missing ones named).
# kernels_gpu.py (written beside the Triton kernels): called as `kernels_gpu.py DIR --budget S` (on the CPU
# `--cpu-dry-run` under TRITON_INTERPRET=1), it writes DIR/kernels_gpu.md and .json; the peers are on its PYTHONPATH too.
RC_E=0; T_E=0; : > "$HELP/peers.log"; : > "$HELP/kernels.log"
if [[ $STEPS == *e* ]]; then
  start=$SECONDS; LEFT=$((BUDGET - (SECONDS - T0))); [ "$LEFT" -lt 60 ] && LEFT=60; [ "$MODE" = cpu ] && LEFT=240
  KERNELS_BENCH=""; [ -f benchmarks/kernels_gpu.py ] && KERNELS_BENCH=benchmarks/kernels_gpu.py
  # The kernels first (three fifths of what is left: the measurement the GPU is lent for), then the peers.
  if [ -n "$KERNELS_BENCH" ]; then
    K_LEFT=$((LEFT * 3 / 5)); [ "$K_LEFT" -lt 60 ] && K_LEFT=60; [ "$MODE" = cpu ] && K_LEFT=180
    KARGS="--budget $((K_LEFT * 2 / 3))"; [ "$MODE" = cpu ] && KARGS="--cpu-dry-run"
    say "(e) $KERNELS_BENCH (at most $K_LEFT s), then the peers"
    # shellcheck disable=SC2086
    ( [ "$MODE" = cpu ] && export TRITON_INTERPRET=1; timeout -k 10 "$K_LEFT" "$PY" "$KERNELS_BENCH" "$OUTDIR" $KARGS ) \
      > "$HELP/kernels.log" 2>&1 || RC_E=2
  fi
  P_LEFT=$((BUDGET - (SECONDS - T0))); [ "$P_LEFT" -lt 60 ] && P_LEFT=60; [ "$MODE" = cpu ] && P_LEFT=120
  if [ "$MODE" = cpu ]; then PSIZES="256 512"; PARGS="--dim 32 --repeats 1"
  elif [ "$P_LEFT" -lt 90 ]; then PSIZES="16384"; PARGS="--dim 1024 --repeats 3"
  else PSIZES="16384 65536"; PARGS="--dim 1024 --repeats 3"; fi
  say "(e) peers at N = $PSIZES (at most $P_LEFT s)"
  # shellcheck disable=SC2086
  timeout -k 10 "$P_LEFT" "$PY" benchmarks/peers_gpu.py --out "$HELP" --device "$DEV" --sizes $PSIZES $PARGS \
    --limit-s $((P_LEFT - 40)) > "$HELP/peers.log" 2>&1 || RC_E=$((RC_E + 1))
  [ -f "$HELP/peers.json" ] && cp "$HELP/peers.json" "$OUTDIR/peers.json"
  T_E=$((SECONDS - start))
  cat "$HELP/peers.log" "$HELP/kernels.log" >> "$ENV_LOG"
  [ -f "$HELP/peers.md" ] && cat "$HELP/peers.md" || tail -20 "$HELP/peers.log"
fi

# --- summary --------------------------------------------------------------------------------------------
DRY_STRICT=""; [ "$MODE" = cpu ] && DRY_STRICT="; CPU: strict device mode"
status() { [[ $STEPS == *$1* ]] || { echo skipped; return; }; [ "$2" = 0 ] && echo PASS || echo "FAIL (exit $2)"; }
{
  echo "# distlab GPU check ($MODE): torch $TV$COMPAT, device $DEV, $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)"
  echo
  echo "| step | result | seconds |"
  echo "|---|---|---:|"
  echo "| (a) step at P = 1 on $DEV = plain autograd (float64, float32, bf16; InfoNCE/sigmoid, gather/ring, recompute with dropout, strict mode) | $(status a $RC_A) | $T_A |"
  echo "| (b) multi-rank tests on CPU/gloo | $(status b "$RC_B"): $(grep -E '[0-9]+ (passed|failed)' "$OUTDIR/pytest_cpu.log" 2>/dev/null | tail -1) | $T_B |"
  echo "| (b2) the step at P = 2, 4, 8 on CPU/gloo = plain autograd; lesson 25 at P = 8 | $(status b "$RC_B2"): $(grep -c PASS "$HELP/ranks.log" 2>/dev/null) PASS, $(grep -c FAIL "$HELP/ranks.log" 2>/dev/null) FAIL; lesson 25: $(grep -E 'PASS: every|FAIL: [0-9]' "$HELP/lesson14_p8.log" 2>/dev/null | tail -1) | $T_B |"
  echo "| (c) lessons at P = 1, --device $DEV (every one expected to pass${DRY_STRICT}) | $(awk -F'\t' '$2==0' "$HELP/lessons.tsv" | wc -l) of $(wc -l < "$HELP/lessons.tsv") exit 0$(awk -F'\t' '$2!=0 {printf "; FAIL %s", $1}' "$HELP/lessons.tsv") | $T_C |"
  echo "| (d) timing | $(status d $RC_D) | $T_D |"
  echo "| (e) peers ($PEERS)${KERNELS_BENCH:+ and $KERNELS_BENCH} | $(status e $RC_E) | $T_E |"
  echo "| total | | $((SECONDS - T0)) |"
  echo
  echo "## (a)"; echo '```'; grep -E "PASS|FAIL|device" "$HELP/equiv.log"; echo '```'
  echo "## (c)"; echo '```'; cat "$HELP/lessons.tsv"; echo '```'
  echo "## (d)"; [ -f "$OUTDIR/timing.md" ] && cat "$OUTDIR/timing.md"
  echo "## (e)"; [ -f "$HELP/peers.md" ] && cat "$HELP/peers.md"; [ -f "$OUTDIR/kernels_gpu.md" ] && cat "$OUTDIR/kernels_gpu.md"
} > "$SUMMARY"
# The device tool brings back at most 8 files: past 7, the JSON records travel as one archive.
if [ "$(find "$OUTDIR" -maxdepth 1 -type f | wc -l)" -gt 7 ]; then
  (cd "$OUTDIR" && tar czf records.tar.gz ./*.json && rm -f ./*.json)
fi
say "done in $((SECONDS - T0)) s; results in $OUTDIR: $(ls "$OUTDIR" | tr '\n' ' ')"
head -12 "$SUMMARY"
[ "$RC_A" = 0 ] && [ "$RC_B" = 0 ] && [ "$RC_B2" = 0 ] && [ "$RC_C" = 0 ] && [ "$RC_D" = 0 ] && [ "$RC_E" = 0 ]
