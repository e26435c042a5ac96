"""`distributed_backward` and `distributed_train_step` equal single-process full-batch training.

Every case runs under `spawn` at P in {1, 2, 3} and is compared with an independent reference: a deep
copy of the model, the whole global batch in one process, plain autograd on the symmetric InfoNCE
with the logit scale as an ordinary tensor (`full_batch` below; no streaming, no closed forms, no
gathers). With dropout, the reference draws each rank's masks from that rank's random stream, one
forward per micro-batch of the split the step promises (the fewest parts of at most B rows, sizes
within one), so it sees the masks the step says it used. Starting ranks is the slow part on a 2-core
machine, so each world size runs all its cases in one `spawn`.
"""

import copy
import math

import pytest
import torch
from streamed_helpers import DROPOUT_SEED, Towers, full_batch, local_rows, rank_streams
from streamed_helpers import STREAMED_N as N
from torch.nn.parallel import DistributedDataParallel as DDP

from distlab.contrastive.losses import clip_loss
from distlab.data_split.data_parallel.ddp import counting
from distlab.processes.spawn import spawn
from distlab.proof.compare import all_ok, compare, grads_of, params_of
from distlab.proof.models import paired_data
from distlab.streamed import loss_machinery
from distlab.streamed.safeguards import agree_gradients_finite
from distributed_clip import distributed_backward, distributed_train_step


def case_model(case):
    return Towers(scale_shape=case.get("scale"), dropout=case.get("dropout", 0.0))


def config_of(case, n=N):
    config = {"GLOBAL_BATCH_SIZE": n, "MICRO_BATCH_SIZE": case["b"], "STREAM_CHUNK_SIZE": case.get("t", 7)}
    if case.get("scale") is None:
        config["TAU"] = 0.1
    return config | ({"NORMALISERS": case["normalisers"]} if "normalisers" in case else {})


def optimizer_of(params, case):
    return torch.optim.Adam(params, lr=0.01) if case.get("adam") else torch.optim.SGD(params, lr=0.5)


def reference(case, world, seed_shift=0):
    """Train a deep copy on the whole global batch in one process, plain autograd."""
    model = copy.deepcopy(case_model(case))
    optimizer = optimizer_of(model.parameters(), case)
    streams = rank_streams(world, DROPOUT_SEED + seed_shift) if case.get("dropout") else None
    losses, first = [], {}
    for step in range(case.get("steps", 1)):
        x, y = paired_data(N, seed=step)
        optimizer.zero_grad()
        loss = full_batch(model, x, y, world, case["b"], None if "scale" in case else 0.1, streams)
        loss.backward()
        losses.append(loss.item())
        first = first or grads_of(model)
        optimizer.step()
    return {"grads": first, "params": params_of(model), "losses": losses}


def train(rt, case):
    """The classic loop: distributed_train_step on this rank's share of each global batch."""
    model = case_model(case)
    ddp = DDP(model)
    optimizer = optimizer_of(ddp.parameters(), case)
    torch.manual_seed(DROPOUT_SEED + rt.rank)
    losses, first = [], {}
    for step in range(case.get("steps", 1)):
        x, y = paired_data(N, seed=step)
        rows = local_rows(rt)
        losses.append(distributed_train_step(ddp, optimizer, x[rows], y[rows], config_of(case)))
        first = first or grads_of(model)
    return {"grads": first, "params": params_of(model), "losses": losses}


def assert_matches(got, ref):
    assert all_ok(compare(ref["grads"], got["grads"])), "first-step gradients differ"
    assert all_ok(compare(ref["params"], got["params"])), "parameters differ"
    assert torch.allclose(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=1e-10, atol=1e-12)


def cases(world):
    c = N // world
    return [
        dict(scale=(), b=5, t=7, steps=2),  # learnable s, B not dividing C
        dict(scale=(1,), b=c // 2, t=100, normalisers="replicated"),  # B dividing C, T > N
        dict(scale=(), b=c, steps=2, adam=True, dropout=0.3),  # one forward, dropout as in DDP
        dict(b=4, t=5, steps=2, dropout=0.3),  # TAU, recompute with dropout replay
    ]


def run_cases(rt):
    return [train(rt, case) for case in cases(rt.world_size)]


@pytest.mark.parametrize("world", [1, 3])
def test_train_step_equals_full_batch_training(world):
    runs = spawn(run_cases, world, timeout_s=120)
    for k, case in enumerate(cases(world)):
        ref = reference(case, world)
        for per_rank in runs:  # every rank holds the same global gradient, parameters and loss
            assert_matches(per_rank[k], ref)


# ---------------------------------------------------------------------------------------------
# P = 2: everything a caller-owned loop does, in one spawn
# ---------------------------------------------------------------------------------------------


def count_rows(model):
    """Rows through encoder_x's forward: C per step with one forward, 2C with the recompute."""
    seen = [0]
    model.encoder_x.register_forward_hook(lambda m, args, out: seen.__setitem__(0, seen[0] + len(args[0])))
    return seen


def caller_owned(rt):
    out = {"exact": run_cases(rt)}
    x, y = paired_data(N, seed=0)
    x2, y2 = paired_data(N, seed=1)
    rows = local_rows(rt)
    learn = dict(scale=(), b=5)

    # The loss machinery alone (benchmarks use it): this rank's embeddings in, L and its rows' G out.
    with torch.no_grad():
        z_x, z_y = Towers()(x[rows], y[rows])
    out["machinery"] = loss_machinery(z_x, z_y, config_of(dict(b=5)))

    # Forwards: one per pair with B >= C, two with B < C.
    for b in (N // 2, 5):
        model = Towers(scale_shape=(), dropout=0.3)
        seen = count_rows(model)
        torch.manual_seed(DROPOUT_SEED + rt.rank)
        distributed_backward(DDP(model), x[rows], y[rows], config_of(dict(scale=(), b=b)))
        out[f"rows_b{b}"], out[f"grads_b{b}"] = seen[0], grads_of(model)

    # distributed_backward + clip_grad_norm_ + step.
    model = Towers(scale_shape=())
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.5)
    out["loss"] = distributed_backward(ddp, x[rows], y[rows], config_of(learn))
    out["norm"] = torch.nn.utils.clip_grad_norm_(ddp.parameters(), 0.05).item()
    opt.step()
    out["clipped"] = params_of(model)

    # Accumulation: the first call under no_sync reduces nothing, the second reduces once; in both regimes.
    for b in (5, N // 2):
        model = Towers(scale_shape=())
        ddp = DDP(model)
        counter = counting(ddp)
        with ddp.no_sync():
            distributed_backward(ddp, x[rows], y[rows], config_of(dict(scale=(), b=b)))
        out[f"hook_after_first_b{b}"] = counter.calls
        distributed_backward(ddp, x2[rows], y2[rows], config_of(dict(scale=(), b=b)))
        out[f"hook_after_second_b{b}"], out[f"accumulated_b{b}"] = counter.calls, grads_of(model)
    plain = DDP(Towers(scale_shape=()))
    plain_counter = counting(plain)
    clip_loss(*plain(x[rows], y[rows])).backward()
    out["hook_plain_backward"] = plain_counter.calls

    # GradScaler: unscaled gradients exact; an inf in one rank's batch skips the step, halves the scale.
    model = Towers(scale_shape=())
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    distributed_backward(ddp, x[rows], y[rows], config_of(learn), grad_scaler=scaler)
    out["scaled"] = grads_of(model)
    scaler.unscale_(opt)
    out["unscaled"] = grads_of(model)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
    before = params_of(model)
    bad_x = x[rows].clone()
    if rt.rank == rt.world_size - 1:
        bad_x[0] = float("inf")  # +inf and -inf meet in the first Linear: NaN embeddings
    out["inf_loss"] = distributed_backward(ddp, bad_x, y[rows], config_of(learn), grad_scaler=scaler)
    scaler.step(opt)
    scaler.update()
    out["scale_after_inf"] = scaler.get_scale()
    out["inf_untouched"] = all(torch.equal(before[k], v) for k, v in params_of(model).items())

    # NaN in one rank's batch: train_step raises FloatingPointError on every rank before the step.
    model = Towers(scale_shape=())
    ddp = DDP(model)
    opt = torch.optim.Adam(ddp.parameters(), lr=0.1)
    before = params_of(model)
    nan_x = x[rows].clone()
    if rt.rank == 0:
        nan_x[1] = float("nan")
    try:
        distributed_train_step(ddp, opt, nan_x, y[rows], config_of(learn))
        out["nan"] = "no error"
    except FloatingPointError as err:
        out["nan"] = f"FloatingPointError: {err}"
    out["nan_untouched"] = all(torch.equal(before[k], v) for k, v in params_of(model).items())
    return out


def test_caller_owned_loop_clip_accumulation_scaler_and_nan_at_p2():
    world = 2
    results = spawn(caller_owned, world, timeout_s=120)
    for k, case in enumerate(cases(world)):
        ref = reference(case, world)
        for r in results:
            assert_matches(r["exact"][k], ref)
    one = reference(dict(scale=(), b=5), world)
    z = [t.detach().requires_grad_() for t in Towers()(*paired_data(N, seed=0))]
    loss = clip_loss(*z, 1 / 0.1)
    loss.backward()
    dropout_refs = {b: reference(dict(scale=(), b=b, dropout=0.3), world) for b in (N // 2, 5)}
    for rank, r in enumerate(results):
        machinery_loss, g_x, g_y = r["machinery"]
        mine = slice(rank * N // world, (rank + 1) * N // world)
        assert math.isclose(machinery_loss, loss.item(), rel_tol=1e-10)
        assert all_ok(compare({"G_x": z[0].grad[mine], "G_y": z[1].grad[mine]}, {"G_x": g_x, "G_y": g_y}))
        assert r["rows_b12"] == N // world and r["rows_b5"] == 2 * N // world  # one forward vs recompute
        for b, ref in dropout_refs.items():
            assert all_ok(compare(ref["grads"], r[f"grads_b{b}"])), b
        assert math.isclose(r["loss"], one["losses"][0], rel_tol=1e-10)

        # Clipping: the reference clipped by hand, from its own gradient norm.
        total = torch.sqrt(sum((g**2).sum() for g in one["grads"].values())).item()
        assert math.isclose(r["norm"], total, rel_tol=1e-10)
        model = Towers(scale_shape=())
        clipped = {
            k: p.detach() - 0.5 * one["grads"][k] * min(1.0, 0.05 / (total + 1e-6)) for k, p in model.named_parameters()
        }
        assert all_ok(compare(clipped, r["clipped"]))

        # Accumulation: the sum of the two batches' references, with DDP's all-reduce run once.
        second = reference_on(dict(scale=(), b=5), world, seed=1)
        for b in (5, N // 2):
            assert all_ok(compare({k: one["grads"][k] + second[k] for k in second}, r[f"accumulated_b{b}"]))
            assert r[f"hook_after_first_b{b}"] == 0
            assert r[f"hook_after_second_b{b}"] == r["hook_plain_backward"] >= 1

        # GradScaler.
        assert all_ok(compare({k: 2.0**10 * g for k, g in one["grads"].items()}, r["scaled"]))
        assert all_ok(compare(one["grads"], r["unscaled"]))
        assert not math.isfinite(r["inf_loss"]) and r["scale_after_inf"] == 2.0**9 and r["inf_untouched"]

        assert r["nan"].startswith("FloatingPointError") and r["nan_untouched"], r["nan"]
    # Teeth: the dropout check would catch masks from other random streams.
    shifted = reference(dict(scale=(), b=5, dropout=0.3), world, seed_shift=7)
    assert not all_ok(compare(shifted["grads"], results[0]["grads_b5"]))


def reference_on(case, world, seed):
    """Gradients of a fresh model's full-batch loss on the global batch paired_data(N, seed)."""
    model = case_model(case)
    x, y = paired_data(N, seed=seed)
    full_batch(model, x, y, world, case["b"]).backward()
    return grads_of(model)


class NaNInBackward(torch.autograd.Function):
    """The identity forward (the loss stays finite), a NaN gradient backward: a backward that overflowed."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * float("nan")


def nan_backward(rt):
    x, y = paired_data(N, seed=0)
    rows, config = local_rows(rt), config_of(dict(scale=(), b=5))
    model = Towers(scale_shape=())
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=0.1)
    distributed_train_step(ddp, opt, x[rows], y[rows], config)  # one good step: AdamW holds moments now
    before, state = params_of(model), copy.deepcopy(opt.state_dict()["state"])
    if rt.rank == 1:
        model.encoder_x.register_forward_hook(lambda module, inputs, out: NaNInBackward.apply(out))
    out = {}
    try:
        distributed_train_step(ddp, opt, x[rows], y[rows], config)
        out["nan"] = "no error"
    except FloatingPointError as err:
        out["nan"] = str(err)
    after = opt.state_dict()["state"]
    out["params_untouched"] = all(torch.equal(before[k], v) for k, v in params_of(model).items())
    out["state_untouched"] = all(torch.equal(state[i][k], after[i][k]) for i in state for k in state[i])
    out["grads_dropped"] = all(p.grad is None for p in model.parameters())

    # A non-finite gradient on one rank only (a shard, under FSDP2): every rank refuses, naming it.
    for p in model.parameters():
        p.grad = torch.full_like(p, float("nan") if rt.rank == 1 and p is model.logit_scale else 0.0)
    try:
        agree_gradients_finite(ddp)
        out["one_rank"] = "no error"
    except FloatingPointError as err:
        out["one_rank"] = str(err)

    # Teeth: without the check, the same backward's NaN reaches every rank's parameters.
    opt.zero_grad(set_to_none=True)
    distributed_backward(ddp, x[rows], y[rows], config)
    opt.step()
    out["unchecked_reaches_params"] = not all(torch.isfinite(p).all() for p in model.parameters())
    return out


def test_a_finite_loss_with_a_nan_backward_stops_every_rank_before_the_step():
    results = spawn(nan_backward, 2, timeout_s=120)
    assert results[0]["nan"] == results[1]["nan"] != "no error", results
    assert "non-finite gradient" in results[0]["nan"] and "module.encoder_x" in results[0]["nan"], results[0]["nan"]
    for r in results:
        assert r["params_untouched"] and r["state_untouched"] and r["grads_dropped"], r
        assert r["one_rank"].startswith("rank 1: a non-finite gradient") and "module.logit_scale" in r["one_rank"]
        assert r["unchecked_reaches_params"]
