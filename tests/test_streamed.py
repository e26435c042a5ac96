"""The streamed five-phase step (`distributed_clip.distributed_train_step`) equals single-process
full-batch training on the symmetric InfoNCE, for any P, B, M and both Phase B variants.

The reference is independent: a deep copy of the model, the whole global batch in one process, plain
autograd on `clip_loss` (no streaming, no closed forms, no gathers). Many configurations run in one
`spawn` per world size, because starting ranks is the slow part on a 2-core machine.
"""

import math

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from distlab.compare import all_ok, compare, grads_of, params_of
from distlab.contrastive.gather import gather_with_grad
from distlab.contrastive.losses import clip_loss, local_clip_loss
from distlab.contrastive.streamed import (Embedded, chunks, phase_a_embed, phase_b_normalisers,
                                          phase_c_embedding_grads, phase_d_backward,
                                          phase_e_sync_point, streamed_lse, streamed_lse_both,
                                          streamed_softmax_pair_product)
from distlab.contrastive.streamed_config import validate_step
from distlab.memory import PeakMemory
from distlab.models import TwoTower, paired_data
from distlab.runtime import spawn
from distributed_clip import distributed_train_step

N = 24  # divisible by 1, 2, 3 and 4
DROPOUT_SEED = 100  # rank r's dropout stream starts from torch.manual_seed(DROPOUT_SEED + r)


# ---------------------------------------------------------------------------------------------
# The kernels against autograd, one process
# ---------------------------------------------------------------------------------------------


def _kernel_grads(z_x, z_y, tau, m):
    """Phases B and C on one process (P = 1, one micro-batch): a, b, G_x, G_y."""
    a, nll_x, b, nll_y = streamed_lse_both(z_x, z_y, tau, m)
    coef, scale = torch.expm1(-nll_x) + torch.expm1(-nll_y), 1 / (2 * len(z_x) * tau)
    g_x = streamed_softmax_pair_product(z_x, z_y, a, b, coef, 0, tau, m) * scale
    g_y = streamed_softmax_pair_product(z_y, z_x, b, a, coef, 0, tau, m) * scale
    return a, b, g_x, g_y


@pytest.mark.parametrize("m", [1, 5, 37, 100])  # M = 1, M not dividing N, M = N, M > N
@pytest.mark.parametrize("unit_norm", [True, False])
def test_closed_form_gradient_equals_autograd(m, unit_norm):
    gen = torch.Generator().manual_seed(m)
    z_x, z_y = (torch.randn(37, 6, generator=gen, dtype=torch.float64) for _ in range(2))
    if unit_norm:
        z_x, z_y = torch.nn.functional.normalize(z_x, dim=1), torch.nn.functional.normalize(z_y, dim=1)
    tau = 0.07
    leaf_x, leaf_y = z_x.clone().requires_grad_(), z_y.clone().requires_grad_()
    clip_loss(leaf_x, leaf_y, tau).backward()
    a, b, g_x, g_y = _kernel_grads(z_x, z_y, tau, m)
    s = z_x @ z_y.T / tau
    assert all_ok(compare({"a": s.logsumexp(1), "b": s.logsumexp(0), "g_x": leaf_x.grad, "g_y": leaf_y.grad},
                          {"a": a, "b": b, "g_x": g_x, "g_y": g_y}))
    lse, nll = streamed_lse(z_y[3:], z_x, tau, m, offset=3)  # rows 3.. of S^T: the sharded variant
    assert torch.allclose(lse, s.logsumexp(0)[3:], rtol=1e-12, atol=0)
    assert torch.allclose(nll, -torch.log_softmax(s.T, 1).diagonal()[3:], rtol=1e-10, atol=1e-13)


def test_the_kernel_check_catches_a_wrong_gradient():
    """The seed's formula without Q (one direction only) is visibly wrong: the check has teeth."""
    gen = torch.Generator().manual_seed(0)
    z_x, z_y = (torch.randn(10, 4, generator=gen, dtype=torch.float64) for _ in range(2))
    leaf_x = z_x.clone().requires_grad_()
    clip_loss(leaf_x, z_y, 0.5).backward()
    a, b, g_x, _ = _kernel_grads(z_x, z_y, 0.5, 3)
    one_way = (torch.softmax(z_x @ z_y.T / 0.5, 1) @ z_y - z_y) / (2 * 10 * 0.5)
    assert all_ok(compare({"g": leaf_x.grad}, {"g": g_x}))
    assert not all_ok(compare({"g": leaf_x.grad}, {"g": one_way}))


@pytest.mark.parametrize("confidence", [0.0, 1.0, 3.0])  # loss ~65, ~0.5, ~2e-6 at tau = 0.01
def test_float32_at_tau_001_is_as_precise_as_autograd(confidence):
    """float32 against the float64 truth: within 1e-5 relative, and in the confident regime (positives
    far above the rest, nll ~1e-6) no worse than float32 autograd; the diagonal P_ii + Q_ii - 2 is
    where a naive a_i - S_ii (two numbers ~1/tau = 100) would lose every digit."""
    gen = torch.Generator().manual_seed(1)
    z_x, z_y = (torch.nn.functional.normalize(torch.randn(300, 16, generator=gen), dim=1) for _ in range(2))
    z_y = torch.nn.functional.normalize(z_y + confidence * z_x, dim=1)
    truth = [z.double().requires_grad_() for z in (z_x, z_y)]
    clip_loss(*truth, 0.01).backward()
    f32 = [z.clone().requires_grad_() for z in (z_x, z_y)]
    clip_loss(*f32, 0.01).backward()
    _, _, g_x, g_y = _kernel_grads(z_x, z_y, 0.01, 64)
    for got, auto, ref in zip((g_x, g_y), f32, truth):
        ours = ((got.double() - ref.grad).abs().max() / ref.grad.abs().max()).item()
        theirs = ((auto.grad.double() - ref.grad).abs().max() / ref.grad.abs().max()).item()
        assert ours < max(1e-5, 2 * theirs), (ours, theirs)


# ---------------------------------------------------------------------------------------------
# The whole step under DDP against single-process full-batch training
# ---------------------------------------------------------------------------------------------


def _config(n, b, m, tau, phase_b):
    return {"GLOBAL_BATCH_SIZE": n, "MICRO_BATCH_SIZE": b, "STREAM_CHUNK_SIZE": m, "TAU": tau,
            "PHASE_B": phase_b}


def _optimizer(params, name):
    return torch.optim.Adam(params, lr=0.01) if name == "adam" else torch.optim.SGD(params, lr=0.5)


def _train(rt, n=N, b=5, m=7, phase_b="sharded", tau=0.1, steps=1, dtype=torch.float64, dropout=0.0,
           optim="sgd", seed=0):
    model = TwoTower(dropout=dropout, seed=seed, dtype=dtype)
    ddp = DDP(model)
    optimizer = _optimizer(ddp.parameters(), optim)
    rows = slice(rt.rank * n // rt.world_size, (rt.rank + 1) * n // rt.world_size)
    torch.manual_seed(DROPOUT_SEED + rt.rank)
    losses, first = [], {}
    for step in range(steps):
        x, y = paired_data(n, seed=seed + step, dtype=dtype)
        losses.append(distributed_train_step(ddp, optimizer, x[rows], y[rows], _config(n, b, m, tau, phase_b)))
        first = first or grads_of(model)
    return {"grads": first, "params": params_of(model), "losses": losses}


def _run_cases(rt, cases):
    return [_train(rt, **case) for case in cases]


def _reference(world, n=N, b=5, m=7, phase_b="sharded", tau=0.1, steps=1, dtype=torch.float64,
               dropout=0.0, optim="sgd", seed=0, dropout_seed=DROPOUT_SEED):
    """Full batch, one process, plain autograd on clip_loss. With dropout, rank r's pairs are run in
    its micro-batches, in order, from rank r's random stream: the masks the step claims to use."""
    model = TwoTower(dropout=dropout, seed=seed, dtype=dtype)
    optimizer = _optimizer(model.parameters(), optim)
    streams = []
    for r in range(world):
        torch.manual_seed(dropout_seed + r)
        streams.append(torch.get_rng_state())
    losses, first, c = [], {}, n // world
    for step in range(steps):
        x, y = paired_data(n, seed=seed + step, dtype=dtype)
        optimizer.zero_grad()
        if dropout == 0:
            z_x, z_y = model(x, y)
        else:
            parts = []
            for r in range(world):
                torch.set_rng_state(streams[r])
                parts += [model(x[r * c:][s], y[r * c:][s]) for s in chunks(c, b)]
                streams[r] = torch.get_rng_state()
            z_x, z_y = (torch.cat([p[i] for p in parts]) for i in (0, 1))
        loss = clip_loss(z_x, z_y, tau)
        loss.backward()
        losses.append(loss.item())
        first = first or grads_of(model)
        optimizer.step()
    return {"grads": first, "params": params_of(model), "losses": losses}


def _assert_matches(got, ref, rtol=None, atol=None):
    assert all_ok(compare(ref["grads"], got["grads"], rtol, atol)), "first-step gradients differ"
    assert all_ok(compare(ref["params"], got["params"], rtol, atol)), "parameters differ"
    assert torch.allclose(torch.tensor(got["losses"]), torch.tensor(ref["losses"]),
                          rtol=rtol or 1e-10, atol=atol or 1e-12), (got["losses"], ref["losses"])


def _cases(world):
    c = N // world
    cases = [dict(b=b, m=m, phase_b=variant)
             for variant in ("sharded", "replicated")
             for b, m in ((5, 7), (max(1, c // 2), 100))]  # B not dividing C, M not dividing N; then M > N
    return cases + [
        dict(b=c, m=N, steps=3, optim="adam"),               # several Adam steps, one micro-batch
        dict(b=4, m=5, steps=2, dropout=0.3),                # dropout: the gradient of the reported loss
        dict(b=4, m=5, steps=2, dropout=0.3, phase_b="replicated", optim="adam"),
    ]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_step_equals_full_batch_training(world):
    cases = _cases(world)
    runs = spawn(_run_cases, world, cases, timeout_s=120)
    for case, *per_rank in zip(cases, *runs):
        ref = _reference(world, **case)
        for got in per_rank:  # every rank holds the same (global) gradient, parameters and loss
            _assert_matches(got, ref)


def test_float32_at_tau_001_and_the_check_has_teeth():
    f32 = dict(b=5, m=7, tau=0.01, dtype=torch.float32, steps=2, optim="adam")
    drop = dict(b=4, m=5, dropout=0.3)
    runs = spawn(_run_cases, 2, [f32, drop])
    # float32 against the float32 full batch, relative to each tensor's largest entry.
    ref = _reference(2, **f32)
    rows = compare(ref["grads"], runs[0][0]["grads"])
    assert max(r.max_rel for r in rows) < 1e-5, rows
    assert all_ok(compare(ref["params"], runs[0][0]["params"], 1e-5, 1e-6))
    # Teeth: the dropout run matches its honest reference, and not one whose masks come from other
    # random streams, nor the same model without dropout.
    got = runs[0][1]["grads"]
    assert all_ok(compare(_reference(2, **drop)["grads"], got))
    assert not all_ok(compare(_reference(2, **drop, dropout_seed=DROPOUT_SEED + 7)["grads"], got))
    assert not all_ok(compare(_reference(2, b=4, m=5)["grads"], got))


# ---------------------------------------------------------------------------------------------
# Dropout replay, memory, and bad inputs (one spawn)
# ---------------------------------------------------------------------------------------------


def _step_without_replay(ddp, optimizer, x, y, config):
    """The same phases with D drawing fresh dropout masks: what forgetting RandContext does."""
    cfg = validate_step(ddp, optimizer, x, y, config)
    emb = phase_a_embed(ddp, x, y, cfg)
    emb = Embedded(emb.z_x, emb.z_y, emb.micro, [torch.random.fork_rng() for _ in emb.micro])
    norm = phase_b_normalisers(emb.z_x, emb.z_y, cfg)
    optimizer.zero_grad()
    for k, rows in enumerate(emb.micro):
        g = phase_c_embedding_grads(emb, norm, rows, cfg)
        with phase_e_sync_point(ddp, k == len(emb.micro) - 1):
            phase_d_backward(ddp, x[rows], y[rows], *g, emb.rng[k], cfg.world)
    return norm.loss


def _catch(fn, *args):
    try:
        fn(*args)
    except ValueError as err:
        return f"ValueError: {err}"
    return "no error"


def _bad_inputs_memory_and_replay(rt):
    n, c = 256, 128
    good = _config(n, 16, 16, 0.1, "sharded")
    model = TwoTower(dim_x=4, dim_y=4, hidden=4, embed_dim=4)
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    x, y = paired_data(n, dim_x=4, dim_y=4)
    lx, ly = x[rt.rank * c:(rt.rank + 1) * c], y[rt.rank * c:(rt.rank + 1) * c]

    def without(key):
        return {k: v for k, v in good.items() if k != key}

    bad = {
        "missing key": (ddp, opt, lx, ly, without("TAU")),
        "misspelt key": (ddp, opt, lx, ly, without("MICRO_BATCH_SIZE") | {"MICRO_BATCH": 16}),
        "float batch": (ddp, opt, lx, ly, good | {"MICRO_BATCH_SIZE": 16.0}),
        "string N": (ddp, opt, lx, ly, good | {"GLOBAL_BATCH_SIZE": "256"}),
        "N != P * local": (ddp, opt, lx, ly, good | {"GLOBAL_BATCH_SIZE": 2 * n + 2 * rt.world_size}),
        "N not divisible": (ddp, opt, lx, ly, good | {"GLOBAL_BATCH_SIZE": 2 * n + 1}),
        "B < 1": (ddp, opt, lx, ly, good | {"MICRO_BATCH_SIZE": 0}),
        "M < 1": (ddp, opt, lx, ly, good | {"STREAM_CHUNK_SIZE": -3}),
        "tau = 0": (ddp, opt, lx, ly, good | {"TAU": 0.0}),
        "tau nan": (ddp, opt, lx, ly, good | {"TAU": float("nan")}),
        "phase b": (ddp, opt, lx, ly, good | {"PHASE_B": "both"}),
        "not DDP": (model, opt, lx, ly, good),
        "no encoders": (DDP(torch.nn.Linear(4, 4)), opt, lx, ly, good),
        "x, y sizes": (ddp, opt, lx, ly[:-1], good),
        "unequal ranks": (ddp, opt, x[:c - 1 + 2 * rt.rank], y[:c - 1 + 2 * rt.rank], good),  # 127, 129
    }
    messages = {label: _catch(distributed_train_step, *args) for label, args in bad.items()}

    # Memory: the step against lesson 09's C x N loss, at sizes where N x d < B x N.
    with PeakMemory() as step_mem:
        distributed_train_step(ddp, opt, lx, ly, good)
    with PeakMemory() as l07_mem:
        z_x, z_y = (z.detach().requires_grad_() for z in model(lx, ly))
        loss = local_clip_loss(z_x, z_y, gather_with_grad(z_x), gather_with_grad(z_y), 0.1, rt.rank * c)
        loss.backward()

    # Dropout: without the replay the reported loss and the gradient belong to different masks.
    drop = DDP(TwoTower(dropout=0.3))
    drop_opt = torch.optim.SGD(drop.parameters(), lr=0.0)
    dx, dy = paired_data(N)
    rows = slice(rt.rank * N // rt.world_size, (rt.rank + 1) * N // rt.world_size)
    torch.manual_seed(DROPOUT_SEED + rt.rank)
    replay_loss = _step_without_replay(drop, drop_opt, dx[rows], dy[rows], _config(N, 4, 5, 0.1, "sharded"))
    return {"messages": messages, "step_largest": step_mem.largest_bytes, "step_peak": step_mem.peak_bytes,
            "l07_largest": l07_mem.largest_bytes, "no_replay_grads": grads_of(drop.module),
            "no_replay_loss": replay_loss}


EXPECTED = {
    "missing key": "missing ['TAU']",
    "misspelt key": "did you mean 'MICRO_BATCH_SIZE'",
    "float batch": "must be an int",
    "string N": "must be an int",
    "N != P * local": "N / P =",
    "N not divisible": "not divisible by the world size",
    "B < 1": "'MICRO_BATCH_SIZE'] must be >= 1",
    "M < 1": "'STREAM_CHUNK_SIZE'] must be >= 1",
    "tau = 0": "must be a finite number > 0",
    "tau nan": "must be a finite number > 0",
    "phase b": "'PHASE_B'] must be one of",
    "not DDP": "DistributedDataParallel",
    "no encoders": "lacks ['encoder_x', 'encoder_y']",
    "x, y sizes": "same number of pairs",
    "unequal ranks": "N / P = 128",
}


def test_bad_inputs_fail_on_every_rank_memory_stays_small_and_replay_matters():
    world = 2
    results = spawn(_bad_inputs_memory_and_replay, world, timeout_s=60)
    for label, expected in EXPECTED.items():
        per_rank = [r["messages"][label] for r in results]
        assert all(m.startswith("ValueError") and expected in m for m in per_rank), (label, per_rank)
        if label != "unequal ranks":  # there each rank names its own count
            assert len(set(per_rank)) == 1, per_rank

    n, c, b, m, itemsize = 256, 128, 16, 16, 8
    for r in results:
        # The largest thing the step made is N x 2d (the gathered embeddings), not a B x N slice.
        assert r["step_largest"] < b * n * itemsize, r["step_largest"]
        assert r["step_largest"] <= max(n * 2 * 4, b * m, m * m) * itemsize
        assert r["l07_largest"] >= c * n * itemsize  # the measure would catch a C x N temporary

    ref = _reference(world, b=4, m=5, dropout=0.3)
    assert not all_ok(compare(ref["grads"], results[0]["no_replay_grads"]))
    assert math.isclose(results[0]["no_replay_loss"], ref["losses"][0], rel_tol=1e-10)  # A was right


def test_no_process_group_is_a_clear_error():
    model = TwoTower()
    with pytest.raises(ValueError, match="initialised process group"):
        distributed_train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.zeros(2, 12),
                               torch.zeros(2, 10), _config(2, 1, 1, 0.1, "sharded"))
