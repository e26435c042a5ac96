"""Lessons 06 and 07's hand-written data parallelism and ZeRO on the shapes real models have (issue 41).

`distlab.proof.models.RealShapes` switches each shape on by a flag: a parameter on the root module (`logit_scale`), an
embedding / output weight tied across two children, a frozen tower and a frozen bias, a branch forward never
takes; `seeds` starts every rank from its own seed, so only a broadcast at construction makes the replicas one
model. Every mechanism written by hand (lesson 06's all-reduce loop and `GradientBuckets`, lesson 07's
`Replicated`, ZeRO-1, -2, -3) and FSDP2 trains each shape for 3 steps, float64, against one process: a deep
copy of rank 0's model on the whole batch, plain autograd, plain torch.optim (AdamW, and SGD with momentum and
non-default hyper-parameters, for every stage by hand): step 1's gradients, the parameters (frozen ones
included: never stepped, never decayed), every optimizer state and the losses, to 1e-10. Then the sharded
optimizer around any torch.optim class, bucket caps of 0, the error a branch not taken raises without the
flag, and a compute dtype (bf16 gathered and computed with, float32 master weights and gradients) for ZeRO-3
and FSDP2. One spawn per P (2 and 3) runs every case; each case's outcome is kept, so one test per shape says
which mechanisms failed and how."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from helpers import load_lesson

from distlab.processes.spawn import spawn
from distlab.proof.compare import compare
from distlab.proof.models import SHAPES as ALL
from distlab.proof.models import RealShapes, regression_batch
from distlab.proof.reference import one_process
from distlab.proof.training import Plain, mean_over_ranks, train

N, V, STEPS, SEED, LR, WD = 12, 6, 3, 5, 0.05, 0.1
CAP = 100  # bytes: a few tensors a bucket, so the buckets are several
NONE = {"without": ALL}
SHAPES = {  # name: (RealShapes' arguments, ranks start from different seeds)
    "plain": (NONE, False),  # the control: the lessons' own kind of model
    **{shape: ({"without": tuple(s for s in ALL if s != shape)}, False) for shape in ALL},
    "seeds": (NONE, True),
    "combined": ({}, True),  # all four shapes, from different seeds
}
BY_HAND = ("loop", "buckets", "DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3")
MECHANISMS = (*BY_HAND, "FSDP2")  # FSDP2 (torch's, the slowest to set up) on the combined model only
OPTIMIZERS = {
    "AdamW": functools.partial(torch.optim.AdamW, lr=LR, weight_decay=WD),
    "SGD(momentum=0.9)": functools.partial(torch.optim.SGD, lr=LR, momentum=0.9, dampening=0.1, weight_decay=WD),
    "AdamW(betas=(0.8, 0.95), eps=1e-6)": functools.partial(
        torch.optim.AdamW, lr=LR, betas=(0.8, 0.95), eps=1e-6, weight_decay=WD
    ),
}
RTOL_BF16, ATOL_BF16 = 2e-2, 1e-3  # bf16 compute against one process under the same recipe


def _batch(k: int, dtype=torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    return regression_batch(N, V, V, seed=100 + k, dtype=dtype)


def _rows(t: torch.Tensor, rt) -> torch.Tensor:
    c = t.shape[0] // rt.world_size
    return t[rt.rank * c : (rt.rank + 1) * c].clone()


def _cfg(opt: str, **more):
    from distlab.data_split.sharding.problem import ShardingConfig

    if opt == "AdamW":  # the lessons' own optimizer: lr and weight decay, through the config as always
        return ShardingConfig(lr=LR, weight_decay=WD, **more)
    return ShardingConfig(optimizer=OPTIMIZERS[opt], **more)


def _make(mechanism: str, model, rt, opt: str, flags: dict, seeds: bool):
    """The trainee of `mechanism` around `model`, with only the API a case needs (today's where it suffices)."""
    dp, sharding = load_lesson("data_parallel"), load_lesson("sharding")
    unused = {"find_unused_parameters": True} if "unused" not in flags.get("without", ()) else {}
    if mechanism == "loop":
        if seeds:
            dp.broadcast_parameters(model, rt)
        return Plain(model, OPTIMIZERS[opt](model.parameters()), lambda: dp.all_reduce_gradients(model, rt, **unused))
    if mechanism == "buckets":
        buckets = dp.GradientBuckets(model, rt, CAP, **unused)
        return Plain(model, OPTIMIZERS[opt](model.parameters()), buckets.wait)
    if mechanism == "DDP":
        from distlab.data_split.sharding.replicated import Replicated

        return Replicated(model, rt, _cfg(opt))
    if mechanism == "FSDP2":
        from distlab.data_split.sharding.fsdp import Fsdp2

        return Fsdp2(model, rt, _cfg(opt))
    return sharding.BY_HAND[mechanism](model, rt, _cfg(opt))


def _check(ref, run, names: list[str], rtol=1e-10, atol=1e-12) -> str | None:
    """None if `run` equals `ref` (step 1's gradients of the trainable parameters, every parameter, every
    optimizer state, the losses); else what differs first."""
    missing = [n for n in names if n not in run.first_grads] + [n for n in ref.params if n not in run.params]
    if missing:
        return f"not read out: {missing}"
    parts = {
        "gradient": compare({n: ref.first_grads[n] for n in names}, {n: run.first_grads[n] for n in names}, rtol, atol),
        "parameter": compare(ref.params, {n: run.params[n] for n in ref.params}, rtol, atol),
    }
    for n in names:
        want, got = ref.states.get(n, {}), run.states.get(n, {})
        if set(want) != set(got):
            return f"optimizer state of {n}: keys {sorted(got)}, one process {sorted(want)}"
        parts[f"state of {n}"] = compare(want, got, rtol, atol)
    for what, rows in parts.items():
        for row in rows:
            if not row.ok:
                return f"{what} {row.name}: max |a-r| / max |r| = {row.max_rel:.3g}"
    if not torch.allclose(torch.tensor(run.losses), torch.tensor(ref.losses), rtol=rtol, atol=atol):
        return f"losses {run.losses} != {ref.losses}"
    return None


@functools.cache
def _reference(shape: str, opt: str):
    """The trainable parameters' names and one process's run of the shape under `opt` (read only: every
    mechanism of a shape is checked against the same run, made once per rank)."""
    reference_model = RealShapes(seed=SEED, **SHAPES[shape][0])
    names = [n for n, p in reference_model.named_parameters() if p.requires_grad]
    return names, one_process(reference_model, _batch, F.mse_loss, OPTIMIZERS[opt], STEPS, keep_states=True)


def _one_case(rt, shape: str, mechanism: str, opt: str) -> str | None:
    flags, seeds = SHAPES[shape]
    names, ref = _reference(shape, opt)
    model = RealShapes(seed=SEED + (rt.rank if seeds else 0), **flags)
    trainee = _make(mechanism, model, rt, opt, flags, seeds)
    batches = [tuple(_rows(t, rt) for t in _batch(k)) for k in range(STEPS)]

    def step(k: int) -> torch.Tensor:
        loss = F.mse_loss(trainee.model(batches[k][0]), batches[k][1])
        loss.backward()
        return loss

    run = train(trainee, step, STEPS, keep_states=True)
    run.losses = mean_over_ranks(run.losses, rt)
    if mechanism == "ZeRO-3":  # what the rank holds is what model.parameters() shows: the shards, the frozen
        held = {id(t) for t in trainee.shards} | {id(p) for p in trainee.frozen.values()}
        if {id(p) for p in model.parameters()} != held:
            return f"ZeRO-3's model.parameters(): {[n for n, _ in model.named_parameters()]}"
    return _check(ref, run, names)


def _guarded(rt, fn, *args) -> str | None:
    """fn's verdict, or the exception it raised (its first line): one case's failure is recorded, the rest run."""
    try:
        return fn(rt, *args)
    except Exception as err:  # noqa: BLE001 - the outcome of today's code, whatever it is, is the record
        return f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"


# ---- the cases beyond the shapes -----------------------------------------------------------------------


def _sharded_optimizer(rt, opt: str) -> str | None:
    """ZeRO-1 as usually taught: `ShardedOptimizer(params, torch.optim.X, **kwargs)` steps the parameters
    this rank owns and broadcasts them; with lesson 06's loop averaging, equal to the unsharded optimizer."""
    from distlab.data_split.sharding.optimizer import ShardedOptimizer

    dp = load_lesson("data_parallel")
    names, ref = _reference("combined", opt)  # every shape, as here
    model = RealShapes(seed=SEED + rt.rank)
    dp.broadcast_parameters(model, rt)
    kwargs = OPTIMIZERS[opt].keywords
    optimizer = ShardedOptimizer(model.parameters(), OPTIMIZERS[opt].func, **kwargs)
    trainee = Plain(model, optimizer, lambda: dp.all_reduce_gradients(model, rt, find_unused_parameters=True))
    batches = [tuple(_rows(t, rt) for t in _batch(k)) for k in range(STEPS)]

    def step(k: int) -> torch.Tensor:
        loss = F.mse_loss(model(batches[k][0]), batches[k][1])
        loss.backward()
        return loss

    run = train(trainee, step, STEPS, keep_states=False)
    run.losses = mean_over_ranks(run.losses, rt)
    run.states = optimizer.states_by_name(model)  # each parameter's state, from the rank that owns it
    owned = sum(len(group["params"]) for group in optimizer.local.param_groups)
    if owned >= len(names):
        return f"rank {rt.rank} owns {owned} of {len(names)} parameters: nothing is sharded"
    return _check(ref, run, names)


def _cap_zero(rt) -> str | None:
    """A bucket cap of 0 means one tensor a bucket (and no empty first bucket)."""
    dp = load_lesson("data_parallel")
    model = RealShapes(seed=SEED, **NONE)
    buckets = dp.GradientBuckets(model, rt, 0)
    sizes = [len(b) for b in buckets.buckets]
    if sizes != [1] * len(list(model.parameters())):
        return f"cap 0: buckets of {sizes} tensors"
    ref = one_process(RealShapes(seed=SEED, **NONE), _batch, F.mse_loss, OPTIMIZERS["AdamW"], 1)
    x, t = (_rows(a, rt) for a in _batch(0))
    F.mse_loss(model(x), t).backward()
    buckets.wait()
    rows = compare(ref.first_grads, {n: p.grad for n, p in model.named_parameters()})
    return None if all(r.ok for r in rows) else "cap 0: gradients differ"


def _unused_refused(rt, mechanism: str) -> str | None:
    """Without find_unused_parameters a branch not taken is one RuntimeError naming the parameter, on every
    rank, before any all-reduce of the step (nothing is left un-averaged)."""
    dp = load_lesson("data_parallel")
    model = RealShapes(seed=SEED, without=("root", "tied", "frozen"))
    sync = dp.GradientBuckets(model, rt, CAP).wait if mechanism == "buckets" else None
    x, t = (_rows(a, rt) for a in _batch(0))
    F.mse_loss(model(x), t).backward()
    try:
        sync() if sync else dp.all_reduce_gradients(model, rt)
    except RuntimeError as err:
        said = str(err)
        return None if "branch.weight" in said and "find_unused_parameters" in said else f"said: {said}"
    return "no error: the step would go on with a parameter no rank has a gradient for"


def _bf16_reference(model, steps: int):
    """One process under the compute-dtype recipe, written out: each step the float32 weights (the master)
    are cast to bf16, forward and backward run in bf16, the gradient comes back to float32 for AdamW."""
    model = copy.deepcopy(model)
    masters = dict(model.named_parameters())
    optimizer = OPTIMIZERS["AdamW"]([p for p in masters.values() if p.requires_grad])
    params = {}
    for k in range(steps):
        low = {n: p.detach().to(torch.bfloat16).requires_grad_(p.requires_grad) for n, p in masters.items()}
        for name, p in model.named_parameters(remove_duplicate=False):  # a tied weight: one bf16 copy
            low.setdefault(name, low[_first_name(model, p)])
        x, t = _batch(k, torch.float32)
        out = torch.func.functional_call(model, low, (x.to(torch.bfloat16),), tie_weights=False)
        F.mse_loss(out.float(), t).backward()
        for n, p in masters.items():
            p.grad = low[n].grad.float() if low[n].grad is not None else None
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    params = {n: p.detach().clone() for n, p in masters.items()}
    return params


def _first_name(model, tensor) -> str:
    return next(n for n, p in model.named_parameters() if p is tensor)


def _compute_dtype(rt, mechanism: str) -> str | None:
    """ZeRO-3 and FSDP2 with compute dtype bf16: float32 shards (the master) stepped, bf16 gathered and computed
    with, gradients reduced in float32; equal to one process under the same recipe at bf16's tolerance, and
    not to the float32 run (the bf16 compute happened)."""
    from distlab.data_split.sharding.fsdp import Fsdp2

    sharding = load_lesson("sharding")
    cfg = _cfg("AdamW", dtype=torch.float32, compute=torch.bfloat16)
    reference_model = RealShapes(seed=SEED, dtype=torch.float32)
    ref = _bf16_reference(reference_model, STEPS)
    plain = one_process(reference_model, lambda k: _batch(k, torch.float32), F.mse_loss, OPTIMIZERS["AdamW"], STEPS)
    model = RealShapes(seed=SEED + rt.rank, dtype=torch.float32)
    trainee = Fsdp2(model, rt, cfg) if mechanism == "FSDP2" else sharding.zero3(model, rt, cfg)
    batches = [tuple(_rows(t, rt) for t in _batch(k, torch.float32)) for k in range(STEPS)]

    def step(k: int) -> torch.Tensor:
        loss = F.mse_loss(trainee.model(batches[k][0]).float(), batches[k][1])
        loss.backward()
        return loss

    run = train(trainee, step, STEPS)
    trained = [n for n, p in reference_model.named_parameters() if p.requires_grad]  # frozen: only computed with
    if any(run.params[n].dtype != torch.float32 for n in trained):
        return f"master weights not float32: {sorted({str(run.params[n].dtype) for n in trained})}"
    if not all(r.ok for r in compare(ref, run.params, RTOL_BF16, ATOL_BF16)):
        return "parameters differ from one process under the bf16 recipe"
    if all(r.ok for r in compare(plain.params, run.params, 1e-6, 1e-7)):
        return "equal to the float32 run: nothing was computed in bf16"
    return None


def _every_case(rt) -> dict[str, str | None]:
    out = {}
    for shape in SHAPES:
        for mechanism in MECHANISMS if shape == "combined" else BY_HAND:
            out[f"{shape} {mechanism}"] = _guarded(rt, _one_case, shape, mechanism, "AdamW")
    for opt in ("SGD(momentum=0.9)", "AdamW(betas=(0.8, 0.95), eps=1e-6)"):
        for mechanism in BY_HAND:
            out[f"{opt} {mechanism}"] = _guarded(rt, _one_case, "combined", mechanism, opt)
        out[f"{opt} ShardedOptimizer"] = _guarded(rt, _sharded_optimizer, opt)
    out["cap 0"] = _guarded(rt, _cap_zero)
    for mechanism in ("loop", "buckets"):
        out[f"refused {mechanism}"] = _guarded(rt, _unused_refused, mechanism)
    for mechanism in ("ZeRO-3", "FSDP2"):
        out[f"bf16 {mechanism}"] = _guarded(rt, _compute_dtype, mechanism)
    out["wrong twin"] = _guarded(rt, _summed_loop)  # here, not in a spawn of its own: one spawn per P
    return out


@pytest.fixture(scope="module")
def outcomes() -> dict[int, list[dict[str, str | None]]]:
    return {p: spawn(_every_case, p, timeout_s=30) for p in (2, 3)}


def _failures(outcomes, p: int, prefix: str) -> dict[str, str]:
    """Every case whose name starts with `prefix` that failed on some rank: what rank 0 (else the first) said."""
    bad = {}
    for name in outcomes[p][0]:
        if name.startswith(prefix):
            said = [ranks[name] for ranks in outcomes[p] if ranks[name] is not None]
            if said:
                bad[name] = said[0]
    return bad


@pytest.mark.parametrize("p", [2, 3])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_every_mechanism_equals_one_process_on_the_shape(outcomes, p, shape):
    assert not _failures(outcomes, p, f"{shape} "), _failures(outcomes, p, f"{shape} ")


@pytest.mark.parametrize("p", [2, 3])
@pytest.mark.parametrize("opt", ["SGD(momentum=0.9)", "AdamW(betas=(0.8, 0.95), eps=1e-6)"])
def test_any_optimizer_with_its_hyper_parameters(outcomes, p, opt):
    assert not _failures(outcomes, p, opt), _failures(outcomes, p, opt)


@pytest.mark.parametrize("p", [2, 3])
@pytest.mark.parametrize("case", ["cap 0", "refused", "bf16"])
def test_bucket_cap_unused_error_and_compute_dtype(outcomes, p, case):
    assert not _failures(outcomes, p, case), _failures(outcomes, p, case)


def _summed_loop(rt) -> str | None:
    """A wrong twin the check must reject: lesson 06's loop without the division by P."""
    dp = load_lesson("data_parallel")
    names, ref = _reference("plain", "AdamW")  # no frozen parameter: every one trained
    model = RealShapes(seed=SEED, **NONE)

    def summed():
        dp.all_reduce_gradients(model, rt)
        for p in model.parameters():
            p.grad.mul_(rt.world_size)

    x, t = (_rows(a, rt) for a in _batch(0))
    trainee = Plain(model, OPTIMIZERS["AdamW"](model.parameters()), summed)
    run = train(trainee, lambda k: F.mse_loss(model(x), t).backward(), STEPS, keep_states=True)
    run.losses = ref.losses
    return _check(ref, run, names)


@pytest.mark.parametrize("p", [2, 3])
def test_the_check_rejects_a_wrong_twin(outcomes, p):
    said = [ranks["wrong twin"] for ranks in outcomes[p]]
    assert all(s is not None and s.startswith("gradient") for s in said), said
