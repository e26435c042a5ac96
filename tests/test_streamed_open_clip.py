"""A stock open_clip `CLIP` drops into `distributed_backward` unchanged (P = 2, float64).

The model (tests/open_clip_like.py) has open_clip's attributes and nothing else: no `encoder_x`,
no `encoder_y`, no subclass. Each case is compared with an independent single-process reference
(a deep copy on the whole global batch, plain autograd, rtol 1e-10): the tuple it returns by default,
open_clip_train's `output_dict=True`, and both backbones frozen with the projections, `ln_final`, the
embeddings and `logit_scale` still trainable. A `logit_bias` (SigLIP's, tuple or dict) selects the sigmoid
loss, whose gradients (the bias's included) equal plain autograd's on the whole batch; in a world
of 4 split into two subgroups, DDP over a subgroup and FSDP2 on a subgroup's 1-D mesh are exact within
each (FSDP2 on the 2-D mesh, HSDP, is one error on every rank); a non-finite embedding on rank 1 is
named in the error on every rank; a rank that dies inside the step leaves the others an error naming it,
within the process group's timeout.
"""

import math
import multiprocessing as mp
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from open_clip_like import CLIP, freeze_backbones, grads_by_name, image_text_data, reference
from streamed_helpers import Towers, local_rows, sigmoid_loss
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from distlab.processes.spawn import free_port, spawn
from distlab.proof.compare import all_ok, compare
from distlab.proof.models import paired_data
from distributed_clip import distributed_backward, distributed_train_step

N = 12  # C = 6 pairs per rank at P = 2
TIMEOUT_S = 8.0  # the process group's timeout in the dead-peer case


def config(b, n=N):
    return {"GLOBAL_BATCH_SIZE": n, "MICRO_BATCH_SIZE": b, "STREAM_CHUNK_SIZE": 5}


CASES = {  # label -> (model factory, B)
    "tuple, one forward": (CLIP, N),
    "tuple, recompute": (CLIP, 4),
    "output_dict, one forward": (lambda: CLIP(output_dict=True), N),
    "output_dict, recompute": (lambda: CLIP(output_dict=True), 4),
    "frozen backbones, one forward": (lambda: freeze_backbones(CLIP(output_dict=True)), N),
    "frozen backbones, recompute": (lambda: freeze_backbones(CLIP()), 4),
}


def error_of(fn, *args) -> str:
    try:
        fn(*args)
    except (ValueError, FloatingPointError) as err:
        return f"{type(err).__name__}: {err}"
    return "no error"


def drop_in(rt):
    images, texts = image_text_data(N)
    rows = local_rows(rt, N)
    out = {}
    for label, (make, b) in CASES.items():
        model = make()
        out[label] = (distributed_backward(DDP(model), images[rows], texts[rows], config(b)), grads_by_name(model))
    for label, output_dict in (("logit_bias, dict", True), ("logit_bias, tuple", False)):
        model = CLIP(output_dict=output_dict, logit_bias=-10.0)
        out[label] = (distributed_backward(DDP(model), images[rows], texts[rows], config(4)), grads_by_name(model))
    model = DDP(CLIP(output_dict=True))
    poisoned = images[rows].clone()
    if rt.rank == 1:
        poisoned[2] = float("nan")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    out["nan on rank 1"] = error_of(distributed_train_step, model, optimizer, poisoned, texts[rows], config(4))
    return out


def test_a_stock_open_clip_model_drops_in_exactly():
    results = spawn(drop_in, 2, timeout_s=60)
    images, texts = image_text_data(N)
    for label, (make, b) in CASES.items():
        ref_loss, ref = reference(make(), images, texts, 2, b)
        if label.startswith("frozen"):
            assert set(ref) == {
                "visual.proj",
                "token_embedding.weight",
                "positional_embedding",
                "ln_final.weight",
                "ln_final.bias",
                "text_projection",
                "logit_scale",
            }, sorted(ref)
        for r in results:
            loss, grads = r[label]
            assert math.isclose(loss, ref_loss, rel_tol=1e-10), label
            assert all_ok(compare(ref, grads)), label  # the same names: nothing frozen got a gradient
    whole = CLIP(logit_bias=-10.0)  # no dropout: one forward of the whole batch is every rank's forwards
    sigmoid_ref = sigmoid_loss(*whole(images, texts))
    sigmoid_ref.backward()
    for label in ("logit_bias, dict", "logit_bias, tuple"):
        for r in results:
            loss, grads = r[label]
            assert math.isclose(loss, sigmoid_ref.item(), rel_tol=1e-10), label
            assert all_ok(compare(grads_by_name(whole), grads)), label
    messages = {r["nan on rank 1"] for r in results}
    assert len(messages) == 1, messages
    message = messages.pop()
    assert message.startswith("FloatingPointError") and "rank 1" in message and "rank 0" not in message, message


def sharded(mesh):
    """Towers (FSDP2 shards no 0-dim logit scale, so not CLIP) under fully_shard on `mesh`."""
    model = Towers(scale_shape=(1,))
    for module in (model.encoder_x, model.encoder_y, model):
        fully_shard(module, mesh=mesh)
    return model


def subgroups(rt):
    """World of 4 as two subgroups {0, 1} and {2, 3}, each training on its own batch: DDP over the
    subgroup, FSDP2 on the subgroup's 1-D mesh; and FSDP2 on the 2-D mesh (HSDP), which is refused."""
    group, _ = dist.new_subgroups(group_size=2)
    hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    member = dist.get_rank(group)
    rows = slice(member * N // 2, (member + 1) * N // 2)
    images, texts = image_text_data(N, seed=rt.rank // 2)
    x, y = paired_data(N, seed=rt.rank // 2)
    out = {}
    for label, b in (("ddp", N), ("ddp", 4), ("fsdp2", 4), ("hsdp", 4)):
        model = CLIP(output_dict=True) if label == "ddp" else sharded(hsdp if label == "hsdp" else hsdp["shard"])
        batch = (images[rows], texts[rows]) if label == "ddp" else (x[rows], y[rows])
        try:
            loss = distributed_backward(DDP(model, process_group=group) if label == "ddp" else model, *batch, config(b))
            grads = grads_by_name(model)  # FSDP2's shards gathered whole, here where the group is
            out[label, b] = (loss, {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in grads.items()})
        except ValueError as err:
            out[label, b] = str(err)
    return out


def test_ddp_and_fsdp2_over_a_subgroup_are_exact_and_hsdp_is_refused_on_every_rank():
    results = spawn(subgroups, 4, timeout_s=60)
    for label, b in (("ddp", N), ("ddp", 4), ("fsdp2", 4)):
        for rank, r in enumerate(results):
            got = r[label, b]
            assert not isinstance(got, str), (label, b, rank, got)
            if label == "ddp":
                ref_loss, ref = reference(CLIP(output_dict=True), *image_text_data(N, seed=rank // 2), 2, b)
            else:
                ref_loss, ref = reference(Towers(scale_shape=(1,)), *paired_data(N, seed=rank // 2), 2, b)
            assert math.isclose(got[0], ref_loss, rel_tol=1e-10), (label, b, rank)
            assert all_ok(compare(ref, got[1])), (label, b, rank)
    refused = {r["hsdp", 4] for r in results}  # one clear error, the same on every rank
    assert len(refused) == 1 and "HSDP" in refused.pop(), [r["hsdp", 4] for r in results]


# -- a rank that dies inside the step ------------------------------------------------------------


def _die_on_third_gather(original):
    calls = []

    def gather(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:  # the exchanges before the forward, after it, then the embeddings
            os._exit(1)
        return original(*args, **kwargs)

    return gather


def _rank_that_may_die(rank, world, port, how, results, release):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=TIMEOUT_S))
    model = CLIP(output_dict=True)
    if rank == 1 and how == "forward":
        model.visual.register_forward_hook(lambda *_: os._exit(1))
    if rank == 1 and how == "gather":
        name = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"  # torch 2.11
        setattr(dist, name, _die_on_third_gather(getattr(dist, name)))
    images, texts = image_text_data(N)
    c = N // world
    ddp = DDP(model)
    start = time.monotonic()
    try:
        distributed_backward(ddp, images[rank * c : (rank + 1) * c], texts[rank * c : (rank + 1) * c], config(c))
        message = "no error"
    except Exception as err:  # noqa: BLE001 - what the survivor saw, whatever it was
        message = f"{type(err).__name__}: {err}"
    results.put((rank, message, time.monotonic() - start))
    release.wait(timeout=TIMEOUT_S + 60)  # rank 0 holds the store: up until every survivor reported
    results.close()
    results.join_thread()
    os._exit(0)  # no teardown: the group has lost a member


def survivors_of(how: str, world: int = 3) -> dict[int, tuple[str, float]]:
    """Run one step on `world` ranks in which rank 1 dies (`how`); each survivor's error and how long
    its step took. spawn would stop the survivors once rank 1 dies, so this launches its own."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "distlab"])  # as spawn's
    results, release = ctx.Queue(), ctx.Event()
    port = free_port()
    procs = [ctx.Process(target=_rank_that_may_die, args=(r, world, port, how, results, release)) for r in range(world)]
    for p in procs:
        p.start()
    out = {}
    try:
        for _ in range(world - 1):
            rank, message, seconds = results.get(timeout=TIMEOUT_S + 60)
            out[rank] = (message, seconds)
    finally:
        release.set()
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    return out


def test_a_rank_that_dies_mid_step_is_named_on_every_survivor_within_the_timeout():
    for how in ("forward", "gather"):
        survivors = survivors_of(how)
        assert sorted(survivors) == [0, 2], (how, survivors)
        for rank, (message, seconds) in survivors.items():
            assert message.startswith("RuntimeError") and "rank 1 " in message and "died" in message, (how, message)
            assert "rank 2 " not in message and "rank 0 " not in message, (how, message)
            assert seconds < TIMEOUT_S, (how, rank, seconds)
