"""The streamed step under what real CLIP training wraps and runs it in: FSDP2, torch.compile(DDP),
a frozen tower (LiT), BatchNorm in training mode, and bf16 autocast with float32-returning towers.

Each case against an independent single-process reference (helpers.full_batch: a deep copy, plain
autograd on the symmetric InfoNCE with the scale as an ordinary tensor), or, for BatchNorm, against
plain DDP training on the same batches (the gradient through an autograd-aware all-gather).
"""

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from streamed_helpers import STREAMED_N as N
from streamed_helpers import Towers, full_batch, local_rows
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from distlab.contrastive.losses import clip_loss
from distlab.processes.spawn import spawn
from distlab.proof.compare import all_ok, compare, grads_of
from distlab.proof.models import paired_data
from distributed_clip import distributed_backward, distributed_train_step


def config(b, tau=None, n=N, t=7):
    return {"GLOBAL_BATCH_SIZE": n, "MICRO_BATCH_SIZE": b, "STREAM_CHUNK_SIZE": t} | ({"TAU": tau} if tau else {})


def full_grads(model):
    """Gradients by name, FSDP2's sharded DTensors gathered whole."""
    return {
        name: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().clone()
        for name, p in model.named_parameters()
        if p.grad is not None
    }


def reference_grads(model, world, b, n=N, seed=0, autocast=False):
    """(loss, gradients) of the full-batch loss on a fresh copy, one forward per micro-batch."""
    x, y = paired_data(n, seed=seed, dtype=next(model.parameters()).dtype)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = full_batch(model, x, y, world, b)
    loss.backward()
    return loss.item(), {k: v for k, v in grads_of(model).items() if v.abs().sum() > 0 or "logit" in k}


class ProjectedTowers(Towers):
    """open_clip's layout: the text projection is a parameter of the model, outside encoder_y, so
    a frozen encoder_y does not make z_y constant."""

    def __init__(self):
        super().__init__(scale_shape=())
        gen = torch.Generator().manual_seed(1)
        self.text_projection = nn.Parameter(torch.randn(8, 8, generator=gen, dtype=torch.float64) * 0.4)

    def forward(self, x, y):
        z_x, z_y, s = super().forward(x, y)
        return z_x, F.normalize(z_y @ self.text_projection, dim=-1), s


def projected_frozen():
    model = ProjectedTowers()
    model.encoder_y.requires_grad_(False)  # the text encoder frozen, its projection trained
    return model


def fsdp2_and_lit(rt):
    x, y = paired_data(N)
    rows = local_rows(rt)
    out = {}
    for label, b, factor in (("fsdp2 recompute", 5, None), ("fsdp2 one forward", N, None), ("fsdp2 summing", 5, 1.0)):
        model = Towers(scale_shape=(1,))  # FSDP2 shards no 0-dim parameter
        fully_shard(model.encoder_x)
        fully_shard(model.encoder_y)
        fully_shard(model)
        for module in (model.encoder_x, model.encoder_y, model) if factor is not None else ():
            module.set_gradient_divide_factor(factor)  # sum instead of average: the step must follow
        out[label] = (distributed_backward(model, x[rows], y[rows], config(b)), full_grads(model))
    # Accumulation the FSDP2 way: sync off for the first call, on for the second (which reduces both).
    model = Towers(scale_shape=(1,))
    for module in (model.encoder_x, model.encoder_y, model):
        fully_shard(module)
    x2, y2 = paired_data(N, seed=1)
    model.set_requires_gradient_sync(False)
    distributed_backward(model, x[rows], y[rows], config(5))
    model.set_requires_gradient_sync(True)
    distributed_backward(model, x2[rows], y2[rows], config(5))
    out["fsdp2 accumulated"] = full_grads(model)
    for label, b in (("lit recompute", 5), ("lit one forward", N), ("partly frozen", 5)):
        model = Towers(scale_shape=())
        frozen = model.encoder_x if label.startswith("lit") else model.encoder_x[0]
        frozen.requires_grad_(False)  # a locked image tower, or its first layer only
        out[label] = (distributed_backward(DDP(model), x[rows], y[rows], config(b)), full_grads(model))
    for label, b in (("projection outside a frozen encoder", 5), ("projection outside, one forward", N)):
        model = projected_frozen()
        out[label] = (distributed_backward(DDP(model), x[rows], y[rows], config(b)), full_grads(model))
    return out


def test_fsdp2_and_a_frozen_tower_are_exact():
    world = 2
    results = spawn(fsdp2_and_lit, world, timeout_s=120)
    fsdp_ref = reference_grads(Towers(scale_shape=(1,)), world, 5)
    lit_model = Towers(scale_shape=())
    lit_model.encoder_x.requires_grad_(False)
    lit_ref = reference_grads(lit_model, world, 5)
    part_model = Towers(scale_shape=())
    part_model.encoder_x[0].requires_grad_(False)
    part_ref = reference_grads(part_model, world, 5)
    second = reference_grads(Towers(scale_shape=(1,)), world, 5, seed=1)[1]
    projected_ref = reference_grads(projected_frozen(), world, 5)
    assert "text_projection" in projected_ref[1]
    for r in results:
        accumulated = r.pop("fsdp2 accumulated")
        assert all_ok(compare({k: v + second[k] for k, v in fsdp_ref[1].items()}, accumulated))
        for label, (loss, grads) in r.items():
            ref_loss, ref = (
                lit_ref
                if label.startswith("lit")
                else part_ref
                if label == "partly frozen"
                else projected_ref
                if label.startswith("projection")
                else fsdp_ref
            )
            assert math.isclose(loss, ref_loss, rel_tol=1e-10), label
            assert all_ok(compare(ref, grads)), label  # LiT: no gradient for the frozen tower at all
    # Teeth: without the step's P-scaling FSDP2's average would be half the gradient.
    half = {k: v / world for k, v in fsdp_ref[1].items()}
    assert not all_ok(compare(half, results[0]["fsdp2 recompute"][1]))


class GatherSummingGrads(torch.autograd.Function):
    """All-gather whose backward sums every rank's gradient for this rank's rows (the plain-DDP way
    to a global contrastive loss)."""

    @staticmethod
    def forward(ctx, z):
        parts = [torch.empty_like(z) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, z)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad)
        c = len(grad) // dist.get_world_size()
        return grad[dist.get_rank() * c : (dist.get_rank() + 1) * c]


def batchnorm_against_plain_ddp(rt):
    """Two steps of distributed_train_step with B >= C (and between them one refused for a NaN), and
    two of plain DDP training on the same batches, from the same model: same gradients, parameters
    and running statistics."""
    rows = local_rows(rt)
    runs = {}
    for method in ("streamed", "plain ddp"):
        model = Towers(scale_shape=(), batchnorm=True)
        ddp = DDP(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.5)
        grads = []
        for step in range(2):
            x, y = paired_data(N, seed=step)
            if method == "streamed":
                if step == 1:  # a step refused for a NaN on rank 1 must leave the running statistics as they were
                    bad_x = x[rows].clone()
                    bad_x[0] = float("nan") if rt.rank == 1 else bad_x[0]
                    with pytest.raises(FloatingPointError):
                        distributed_train_step(ddp, opt, bad_x, y[rows], config(N // rt.world_size))
                distributed_train_step(ddp, opt, x[rows], y[rows], config(N // rt.world_size))
            else:
                opt.zero_grad()
                z_x, z_y, s = ddp(x[rows], y[rows])
                # The autograd-aware gather sums every rank's dL/dz into the owner: P times the
                # gradient, which DDP's average brings back to one.
                loss = clip_loss(GatherSummingGrads.apply(z_x), GatherSummingGrads.apply(z_y), s)
                loss.backward()
                opt.step()
            grads.append(grads_of(model))
        runs[method] = {"grads": grads, "state": {k: v.clone() for k, v in model.state_dict().items()}}
    return runs


def test_batchnorm_with_one_forward_is_exactly_plain_ddp():
    world = 2
    results = spawn(batchnorm_against_plain_ddp, world, timeout_s=120)
    ref_loss, ref = reference_grads(Towers(scale_shape=(), batchnorm=True), world, N // world)
    for r in results:
        for step in range(2):
            assert all_ok(compare(r["plain ddp"]["grads"][step], r["streamed"]["grads"][step]))
        floats = {k: v for k, v in r["plain ddp"]["state"].items() if v.is_floating_point()}
        assert all_ok(compare(floats, {k: r["streamed"]["state"][k] for k in floats}))  # + running stats
        assert all(
            torch.equal(v, r["streamed"]["state"][k]) for k, v in r["plain ddp"]["state"].items() if k not in floats
        )  # num_batches_tracked: one update per step, as in plain DDP
        assert all_ok(compare(ref, r["streamed"]["grads"][0]))
    # Teeth: BatchNorm over the whole global batch in one forward is a different function.
    whole = Towers(scale_shape=(), batchnorm=True)
    clip_loss(*whole(*paired_data(N, seed=0))).backward()
    assert not all_ok(compare(grads_of(whole), results[0]["streamed"]["grads"][0]))


def bf16_autocast(rt, n):
    rows = local_rows(rt, n)
    x, y = paired_data(n, dtype=torch.float32)
    out = {}
    for label, float32_out, b in (
        ("float32 out", ("x", "y"), n),
        ("float32 out, recompute", ("x", "y"), 8),
        ("bf16 x, float32 y", ("y",), n),
    ):
        model = Towers(scale_shape=(), dtype=torch.float32, float32_out=float32_out)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = distributed_backward(DDP(model), x[rows], y[rows], config(b, n=n, t=16))
        out[label] = (loss, full_grads(model))
    return out


def relative_error(got, truth):
    """||g - g_float32|| / ||g_float32|| over all parameters as one vector. (Tensor by tensor the two
    bf16 runs take turns being closer: the towers' bf16 arithmetic dominates every tensor's error.)"""
    flat = [torch.cat([g[k].double().reshape(-1) for k in truth]) for g in (got, truth)]
    return ((flat[0] - flat[1]).norm() / flat[1].norm()).item()


def test_bf16_autocast_is_no_further_from_float32_than_plain_autograd():
    world, n = 2, 64
    results = spawn(bf16_autocast, world, n, timeout_s=120)
    for label, (loss, grads) in results[0].items():
        float32_out = ("x", "y") if label.startswith("float32") else ("y",)
        b = 8 if "recompute" in label else n

        def model(float32_out=float32_out):
            return Towers(scale_shape=(), dtype=torch.float32, float32_out=float32_out)

        float32_loss, truth = reference_grads(model(), world, b, n=n)
        plain_loss, plain = reference_grads(model(), world, b, n=n, autocast=True)
        ours, theirs = relative_error(grads, truth), relative_error(plain, truth)
        assert ours <= theirs, (label, ours, theirs)
        assert ours < 1e-2, (label, ours)  # the bound the README states (measured: 3.9e-3)
        # The loss is computed in float32, not rounded to bf16. With a bf16 z_x, plain autograd's
        # s * z_x stays bf16 (a 0-dim s does not promote it) and its loss is 1.4e-3 off; there the
        # float32 model's loss is the yardstick.
        yardstick = plain_loss if label.startswith("float32") else float32_loss
        assert abs(loss - yardstick) <= 1e-3 * abs(yardstick), (label, loss, plain_loss, float32_loss)
        assert results[1][label][0] == loss  # every rank returns the same loss


def compiled_ddp(rt):
    torch.manual_seed(0)
    model = Towers(scale_shape=(), dtype=torch.float32)
    compiled = torch.compile(DDP(model), backend="aot_eager")
    x, y = paired_data(N, dtype=torch.float32)
    rows = local_rows(rt)
    loss = distributed_backward(compiled, x[rows], y[rows], config(N))
    return loss, full_grads(model)


def test_torch_compile_of_ddp_is_exact_in_float32():
    world = 2
    results = spawn(compiled_ddp, world, timeout_s=120)
    ref_loss, ref = reference_grads(Towers(scale_shape=(), dtype=torch.float32), world, N)
    for loss, grads in results:
        assert math.isclose(loss, ref_loss, rel_tol=1e-5)
        assert all_ok(compare(ref, grads))
