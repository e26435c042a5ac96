"""`distributed_clip.ClipLoss` and `SigLipLoss` where open_clip's trainer plugs its losses.

The model is tests/open_clip_like.py's CLIP (open_clip's layout and forward, float64, dropout 0.3 standing
in for patch dropout). On every rank it runs its C pairs from that rank's random stream, and the loss
module is called on its output as open_clip_train's `train_one_epoch` calls a loss (`loss(**model_out,
output_dict=True)`). The reference is plain autograd on the whole batch in one process
(`contrastive.losses.clip_loss` / `sigmoid_loss` on a deep copy, each rank's dropout replayed:
`full_batch_gradients` with `as_ranks`), rtol 1e-10: at P = 1, 2, 3, 4 under DDP, gathered and in a
ring, the symmetric InfoNCE and the sigmoid loss, every parameter's gradient, the logit scale's and the
bias's included; a local term added beside the loss keeps its own DDP-averaged gradient; FSDP2 with
open_clip's `nonscalar_logit_scale=True`; bf16 autocast no further from float32 than plain autograd
under the same autocast. What it cannot do exactly is one error on every rank.
"""

import math
import re

import pytest
import torch
from open_clip_like import CLIP, image_text_data
from streamed_helpers import DROPOUT_SEED, rank_streams
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from distlab.contrastive.losses import clip_loss, sigmoid_loss
from distlab.contrastive.reference import as_ranks, full_batch_gradients
from distlab.processes.spawn import spawn
from distlab.proof.compare import all_ok, compare
from distlab.streamed.safeguards.exit_hint import HINT
from distributed_clip import ClipLoss, SigLipLoss

N, T = 24, 5  # N divisible by P = 1 ... 4; tiles of at most 5 x 5, so several per rank
BESIDE = 0.1  # the weight of a local term added beside the contrastive loss


def loss_module(kind, exchange, rt):
    """As open_clip_train's create_loss builds it: rank and world size from the launch."""
    make = SigLipLoss if kind == "siglip" else ClipLoss
    return make(rank=rt.rank, world_size=rt.world_size, exchange=exchange, stream_chunk_size=T)


def make_model(kind, **kwargs):
    return CLIP(output_dict=True, dropout=0.3, logit_bias=-10.0 if kind == "siglip" else None, **kwargs)


def grads(model):
    """Gradients by name; FSDP2's sharded ones gathered whole."""
    out = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            out[name] = (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().clone()
    return out


def one_step(rt, kind, exchange, wrap, beside=False):
    """One forward, the loss module, backward: (the loss it returned, the model's gradients)."""
    model = make_model(kind, nonscalar_logit_scale=wrap == "fsdp2")
    if wrap == "fsdp2":  # open_clip's towers first, then the model (every SigLIP config: model.text)
        for module in (model.visual, model.transformer, model):
            fully_shard(module)
        wrapped = model
    else:
        wrapped = DDP(model)
    c = N // rt.world_size
    images, texts = (t[rt.rank * c : (rt.rank + 1) * c] for t in image_text_data(N))
    torch.manual_seed(DROPOUT_SEED + rt.rank)  # rank r's dropout stream
    model_out = wrapped(images, texts)
    losses = loss_module(kind, exchange, rt)(**model_out, output_dict=True)
    assert list(losses) == ["contrastive_loss"]
    total = losses["contrastive_loss"]
    if beside:  # CoCa's caption loss, a regulariser: a local term, averaged by DDP as always
        total = total + BESIDE * model_out["image_features"][:, 0].mean()
    total.backward()
    return losses["contrastive_loss"].item(), grads(model)


CASES = [(kind, exchange) for kind in ("clip", "siglip") for exchange in ("gather", "ring")]


def ddp_cases(rt):
    out = {case: one_step(rt, *case, "ddp") for case in CASES}
    out["clip, beside a local term"] = one_step(rt, "clip", "gather", "ddp", beside=True)
    return out


def reference(kind, world, beside=False, **kwargs):
    """(L, dL/dtheta) of the whole batch, plain autograd, each rank's dropout replayed."""
    model = CLIP(dropout=0.3, logit_bias=-10.0 if kind == "siglip" else None, **kwargs)
    ranks = as_ranks(rank_streams(world))

    contrastive = []  # the contrastive loss alone: what the module returns

    def loss_fn(z_x, z_y, *scale):
        loss = sigmoid_loss(z_x, z_y, *scale) if kind == "siglip" else clip_loss(z_x, z_y, scale[0])
        contrastive.append(loss.item())
        return loss + BESIDE * z_x[:, 0].mean() if beside else loss  # the mean over N of the local terms

    _, grads_ = full_batch_gradients(model, *image_text_data(N), None, loss_fn, forward=ranks)
    return contrastive[0], grads_


def assert_exact(results, ref_loss, ref, label):
    for loss, got in results:
        assert math.isclose(loss, ref_loss, rel_tol=1e-10), (label, loss, ref_loss)
        assert all_ok(compare(ref, got)), (label, [(c.name, c.max_rel) for c in compare(ref, got) if not c.ok])


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_under_ddp_every_gradient_is_the_whole_batchs(world):
    results = spawn(ddp_cases, world, timeout_s=60)
    for kind, exchange in CASES:
        ref_loss, ref = reference(kind, world)
        assert {"logit_scale", "visual.proj"} <= set(ref) and (kind == "clip" or "logit_bias" in ref)
        assert_exact([r[kind, exchange] for r in results], ref_loss, ref, (kind, exchange))
    ref_loss, ref = reference("clip", world, beside=True)
    assert_exact([r["clip, beside a local term"] for r in results], ref_loss, ref, "beside")
    if world > 1:  # teeth: the whole batch without each rank's own dropout stream is another gradient
        _, other = full_batch_gradients(
            CLIP(dropout=0.3), *image_text_data(N), None, forward=as_ranks(rank_streams(world, 7))
        )
        assert not all_ok(compare(other, results[0]["clip", "gather"][1]))


def fsdp2_cases(rt):
    return {case: one_step(rt, *case, "fsdp2") for case in (("clip", "gather"), ("siglip", "ring"))}


def test_under_fsdp2_with_a_nonscalar_logit_scale_every_gradient_is_the_whole_batchs():
    results = spawn(fsdp2_cases, 2, timeout_s=60)
    for kind, exchange in (("clip", "gather"), ("siglip", "ring")):
        ref_loss, ref = reference(kind, 2, nonscalar_logit_scale=True)
        assert ref["logit_scale"].shape == (1,)
        assert_exact([r[kind, exchange] for r in results], ref_loss, ref, (kind, exchange, "fsdp2"))


def bf16_cases(rt):
    c = N // rt.world_size
    images, texts = (t[rt.rank * c : (rt.rank + 1) * c] for t in image_text_data(N))
    out = {}
    for kind, exchange in (("clip", "gather"), ("siglip", "ring")):
        model = CLIP(output_dict=True, logit_bias=-10.0 if kind == "siglip" else None).float()
        ddp = DDP(model)  # held until after the backward: its hooks reduce the gradients
        with torch.autocast("cpu", dtype=torch.bfloat16):
            losses = loss_module(kind, exchange, rt)(**ddp(images.float(), texts), output_dict=True)
        losses["contrastive_loss"].backward()
        out[kind] = (losses["contrastive_loss"].item(), grads(model))
    return out


def relative_error(got, truth):
    """||g - g_float32|| / ||g_float32|| over all parameters as one vector."""
    flat = [torch.cat([g[k].double().reshape(-1) for k in truth]) for g in (got, truth)]
    return ((flat[0] - flat[1]).norm() / flat[1].norm()).item()


def test_under_bf16_autocast_it_is_no_further_from_float32_than_plain_autograd():
    results = spawn(bf16_cases, 2, timeout_s=60)
    images, texts = image_text_data(N)
    for kind in ("clip", "siglip"):
        loss_fn = sigmoid_loss if kind == "siglip" else clip_loss
        model = CLIP(logit_bias=-10.0 if kind == "siglip" else None).float()
        float32_loss, truth = full_batch_gradients(model, images.float(), texts, None, loss_fn)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            plain_loss, plain = full_batch_gradients(model, images.float(), texts, None, loss_fn)
        loss, got = results[0][kind]
        ours, theirs = relative_error(got, truth), relative_error(plain, truth)
        assert ours <= theirs and ours < 2e-2, (kind, ours, theirs)
        assert abs(loss - float32_loss) <= abs(plain_loss - float32_loss) + 1e-3 * abs(float32_loss), (kind, loss)
        assert results[1][kind][0] == loss  # the global loss, the same number on every rank


def refused(rt):
    """Calls the loss modules cannot do exactly, each made on every rank: each rank's error message."""
    c = N // rt.world_size
    z_x, z_y = (torch.nn.functional.normalize(torch.randn(c, 8, dtype=torch.float64), dim=-1) for _ in range(2))
    s, beta = torch.tensor(14.0, dtype=torch.float64), torch.tensor(-10.0, dtype=torch.float64)
    good = ClipLoss(rank=rt.rank, world_size=rt.world_size)
    calls = {
        "unequal shares": lambda: good(z_x[: c - rt.rank], z_y[: c - rt.rank], s),
        "a scale that drifted": lambda: good(z_x, z_y, s * (1 + 0.01 * rt.rank)),
        "the wrong rank": lambda: ClipLoss(rank=0, world_size=rt.world_size)(z_x, z_y, s),
        "SigLIP without its bias": lambda: SigLipLoss(rank=rt.rank, world_size=rt.world_size)(z_x, z_y, s),
        "3-d features on rank 0": lambda: good(z_x[None] if rt.rank == 0 else z_x, z_y, s),
        "one rank in a ring": lambda: ClipLoss(
            rank=rt.rank, world_size=rt.world_size, exchange="ring" if rt.rank else "gather"
        )(z_x, z_y, s),
        "a scale of two numbers": lambda: good(z_x, z_y, torch.ones(2)),
        "a bias that drifted": lambda: SigLipLoss(rank=rt.rank, world_size=rt.world_size)(z_x, z_y, s, beta + rt.rank),
    }
    out = {}
    for label, call in calls.items():
        try:
            call()
            out[label] = "no error"
        except ValueError as err:
            out[label] = str(err)
    out["then a good call"] = good(z_x, z_y, s).item()  # nothing refused above left a collective behind
    return out


def test_what_it_cannot_do_exactly_is_one_error_on_every_rank():
    results = spawn(refused, 2, timeout_s=30)
    expected = {
        "unequal shares": "the pairs C each rank holds (the gather and the ring need equal shares) differs across "
        "ranks: rank 0: 12, rank 1: 11",
        "a scale that drifted": "the logit scale must be finite, > 0 and the same on every rank",
        "the wrong rank": "rank 1: the loss was built with rank=0, world_size=2, but this process is rank 1 of 2",
        "SigLIP without its bias": "SigLipLoss needs the logit_bias",
        "3-d features on rank 0": "rank 0: image_features must be a floating tensor of shape (C, d), got shape "
        "(1, 12, 8)",
        "one rank in a ring": "the exchange differs across ranks: rank 0: gather, rank 1: ring",
        "a scale of two numbers": "logit_scale must be a one-element floating tensor or a number, got shape (2,)",
        "a bias that drifted": "the logit bias must be finite and the same on every rank: rank 0: -10.0, rank 1: -9.0",
    }
    for label, words in expected.items():
        messages = {r[label] for r in results}
        assert len(messages) == 1, (label, messages)
        message = messages.pop()
        assert words in message and message.endswith(HINT), (label, message)
    assert results[0]["then a good call"] == results[1]["then a good call"]


def test_open_clips_arguments_are_taken_or_refused_by_name_and_one_process_needs_no_group():
    ClipLoss(local_loss=True, gather_with_grad=True, cache_labels=True, rank=0, world_size=1, use_horovod=False)
    SigLipLoss(cache_labels=False, rank=0, world_size=1, dist_impl="bidir", chunk_size=0, bidir=True)
    refusals = [
        (lambda: ClipLoss(label_smoothing=0.1), TypeError, "unexpected keyword argument 'label_smoothing'"),
        (lambda: ClipLoss(use_horovod=True), ValueError, "torch.distributed only"),
        (lambda: SigLipLoss(dist_impl="allgather"), ValueError, "dist_impl must be None or one of"),
        (lambda: ClipLoss(dist_impl="gather"), TypeError, "unexpected keyword argument 'dist_impl'"),
        (lambda: ClipLoss(exchange="allgather"), ValueError, "config['EXCHANGE'] must be one of ('gather', 'ring')"),
        (lambda: ClipLoss(stream_chunk_size=0), ValueError, "config['STREAM_CHUNK_SIZE'] must be >= 1"),
        (lambda: ClipLoss(matmul_precision="fp8"), ValueError, "config['MATMUL_PRECISION'] must be one of"),
        (lambda: ClipLoss(local_loss=1), ValueError, "local_loss must be True or False"),
        (lambda: ClipLoss(1, 2), TypeError, "positional"),
    ]
    for make, error, words in refusals:
        with pytest.raises(error, match=re.escape(words)):
            make()
    images, texts = image_text_data(N)
    with pytest.raises(ValueError, match="needs an initialised process group"):
        ClipLoss(rank=1, world_size=2)(*CLIP()(images, texts))
    for kind in ("clip", "siglip"):  # one process, no group: the loss of its own batch, exact
        model, ref_model = (CLIP(dropout=0.0, logit_bias=-10.0 if kind == "siglip" else None) for _ in range(2))
        loss = (SigLipLoss() if kind == "siglip" else ClipLoss(stream_chunk_size=T))(*model(images, texts))
        loss.backward()
        ref_loss, ref = full_batch_gradients(
            ref_model, images, texts, None, sigmoid_loss if kind == "siglip" else clip_loss
        )
        assert math.isclose(loss.item(), ref_loss, rel_tol=1e-10) and all_ok(compare(ref, grads(model))), kind


def test_the_matmul_precision_reaches_the_tiles():
    """matmul_precision="bf16" rounds what the tiles multiply (the embeddings, on the CPU's torch tiles): the
    gradient moves away from the float32 module's by bf16's rounding, no more; the default is float32's."""
    images, texts = image_text_data(N)
    got = {}
    for precision in ("float32", "bf16"):
        model = CLIP(dropout=0.0).float()
        ClipLoss(stream_chunk_size=T, matmul_precision=precision)(*model(images.float(), texts)).backward()
        got[precision] = grads(model)
    assert ClipLoss().settings["MATMUL_PRECISION"] == "float32"  # distributed_backward's default too
    moved = relative_error(got["bf16"], got["float32"])
    assert 1e-5 < moved < 2e-2, moved
