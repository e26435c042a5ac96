"""`distributed_backward` with the sigmoid loss and the ring equals plain autograd on the whole batch.

{InfoNCE, sigmoid} x {gather, ring} x {B >= C, B < C with dropout} under `spawn` at P in {1, 2, 3, 4}
(fewer combinations at P = 1 and 3), each against an independent reference: a deep copy of the model,
the whole global batch in one process, plain autograd of L with s and beta as ordinary tensors (the
sigmoid loss is chosen by what the model returns: a 4-tuple or open_clip's dict with logit_bias).
Float64 to 1e-10, every parameter (s and beta included); and the bytes each rank sent equal the formula
of `distlab.streamed.exchange` for every (loss, exchange, P). Then at P = 2: a frozen tower, FSDP2,
and bf16 autocast within what plain autograd achieves under the same autocast.
"""

import copy

import pytest
import torch
from streamed_helpers import DROPOUT_SEED, SigTowers, Towers, full_batch, local_rows, rank_streams
from streamed_helpers import STREAMED_N as N
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from distlab.processes.spawn import spawn
from distlab.proof.compare import all_ok, compare, grads_of
from distlab.proof.models import paired_data
from distlab.streamed.exchange import expected_bytes, step_ledger
from distributed_clip import distributed_backward

D = 8  # the Towers' embedding width


def model_of(case):
    kwargs = dict(dropout=case.get("dropout", 0.0), dtype=case.get("dtype", torch.float64))
    if case["loss"] == "sigmoid":
        return SigTowers(as_dict=case.get("as_dict", False), scale_shape=case.get("shape", ()), **kwargs)
    return Towers(scale_shape=case.get("shape", ()), **kwargs)


def config_of(case, n=N):
    return {"GLOBAL_BATCH_SIZE": n, "MICRO_BATCH_SIZE": case["b"], "STREAM_CHUNK_SIZE": 5, "EXCHANGE": case["exchange"]}


def full_grads(model):
    """Gradients by name, FSDP2's sharded DTensors gathered whole, zeros where None."""
    return {
        name: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().clone()
        if p.grad is not None
        else torch.zeros_like(p)
        for name, p in model.named_parameters()
    }


def prepare(case):
    model = model_of(case)
    if case.get("frozen"):
        getattr(model, case["frozen"]).requires_grad_(False)
    return model


def step(rt, case, n=N):
    """This rank's distributed_backward on its share; (loss, gradients, bytes sent)."""
    model = prepare(case)
    if case.get("fsdp2"):
        for module in (model.encoder_x, model.encoder_y, model):
            fully_shard(module)
        wrapped = model
    else:
        wrapped = DDP(model)
    torch.manual_seed(DROPOUT_SEED + rt.rank)
    x, y = paired_data(n, dtype=case.get("dtype", torch.float64))
    rows = local_rows(rt, n)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=case.get("bf16", False)):
        loss = distributed_backward(wrapped, x[rows], y[rows], config_of(case, n))
    return loss, full_grads(model), step_ledger.sent


def reference(case, world, n=N, autocast=False):
    """Plain autograd of L on the whole batch, on a deep copy; each rank's dropout stream replayed."""
    model = copy.deepcopy(prepare(case))
    model.as_dict = False  # the same numbers as a tuple: the reference unpacks (z_x, z_y, s, beta)
    streams = rank_streams(world) if case.get("dropout") else None
    x, y = paired_data(n, dtype=case.get("dtype", torch.float64))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = full_batch(model, x, y, world, case["b"], None, streams)
    loss.backward()
    return loss.item(), grads_of(model)


def cases(world):
    c = N // world
    every = [
        dict(loss=loss, exchange=ex, b=b, dropout=drop)
        for loss in ("infonce", "sigmoid")
        for ex in ("gather", "ring")
        for b, drop in ((c, 0.0), (max(2, c // 2), 0.3))
    ]
    if world in (1, 3):  # fewer combinations: the ring and the new loss; B >= C at P = 1, B < C at P = 3
        every = [case for case in every if case["exchange"] == "ring" or case["loss"] == "sigmoid"]
        every = every[::2] if world == 1 else every[1::2]
    return every + ([dict(loss="sigmoid", exchange="ring", b=c, as_dict=True)] if world == 2 else [])


def run_cases(rt):
    return [step(rt, case) for case in cases(rt.world_size)]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_every_loss_and_exchange_equals_the_whole_batch(world):
    runs = spawn(run_cases, world, timeout_s=180)
    for k, case in enumerate(cases(world)):
        ref_loss, ref = reference(case, world)
        for rank, per_rank in enumerate(runs):
            loss, grads, sent = per_rank[k]
            assert abs(loss - ref_loss) <= 1e-10 * abs(ref_loss), (case, loss, ref_loss)
            assert all_ok(compare(ref, grads)), (case, rank)
            assert sent == expected_bytes(case["loss"], case["exchange"], (world, N // world, D), (8, 8)), case


def wrappers_and_precision(rt):
    c = N // rt.world_size
    exact = [
        dict(loss="sigmoid", exchange="ring", b=c // 2, dropout=0.3, frozen="encoder_y"),
        dict(loss="infonce", exchange="ring", b=c, frozen="encoder_x"),
        dict(loss="sigmoid", exchange="ring", b=c // 2, fsdp2=True, shape=(1,)),
        dict(loss="infonce", exchange="ring", b=c, fsdp2=True, shape=(1,)),
    ]
    bf16 = [
        dict(loss=loss, exchange="ring", b=64 // rt.world_size, dtype=torch.float32, bf16=True)
        for loss in ("sigmoid", "infonce")
    ]
    return [step(rt, case) for case in exact], [step(rt, case, n=64) for case in bf16], exact, bf16


def relative_error(got, truth):
    flat = [torch.cat([g[k].double().reshape(-1) for k in truth]) for g in (got, truth)]
    return ((flat[0] - flat[1]).norm() / flat[1].norm()).item()


def test_frozen_tower_fsdp2_and_bf16_autocast_at_p2():
    world = 2
    runs = spawn(wrappers_and_precision, world, timeout_s=180)
    _, _, exact, bf16 = runs[0]
    for k, case in enumerate(exact):
        ref_loss, ref = reference(case, world)
        for rank_run in runs:
            loss, grads, _ = rank_run[0][k]
            assert abs(loss - ref_loss) <= 1e-10 * abs(ref_loss), case
            assert all_ok(compare(ref, grads)), case
    for k, case in enumerate(bf16):
        loss, grads, _ = runs[0][1][k]
        _, truth = reference(case, world, n=64)
        plain_loss, plain = reference(case, world, n=64, autocast=True)
        assert relative_error(grads, truth) <= relative_error(plain, truth), case
        assert abs(loss - plain_loss) <= 1e-2 * abs(plain_loss), (case, loss, plain_loss)
