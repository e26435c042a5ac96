"""Lesson 10: GradCache under DDP on P = 2 ranks gives the single-process global batch's gradients,
with one all-reduce per model and step under no_sync_except_last; its memory follows the chunk.

The reference runs in the parent process: deep copies, plain autograd, one loss over the global batch.
Rank r's chunks run with grad from rank r's seed, in GradCache's order (tower x's chunks, then tower
y's), so dropout draws the masks each rank drew. Float64: rtol 1e-10, atol 1e-12.
"""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from distlab.compare import all_ok, compare, grads_of
from distlab.contrastive.gather import gather_with_grad
from distlab.contrastive.grad_cache import GradCache
from distlab.contrastive.losses import clip_loss, local_clip_loss
from distlab.memory import PeakMemory
from distlab.models import TwoTower, paired_data
from distlab.runtime import spawn

P, N, CHUNK, TAU, SEED = 2, 22, 4, 0.1, 11  # 11 pairs per rank in chunks of 4, 4, 3


def rep_clip_loss(rep_x, rep_y, tau=TAU):
    return clip_loss(F.normalize(rep_x, dim=-1), F.normalize(rep_y, dim=-1), tau)


def ddp_rep_clip_loss(rep_x, rep_y, tau=TAU):
    z_x, z_y = F.normalize(rep_x, dim=-1), F.normalize(rep_y, dim=-1)
    return local_clip_loss(z_x, z_y, gather_with_grad(z_x), gather_with_grad(z_y), tau,
                           offset=dist.get_rank() * len(z_x))


def towers(shared):
    """(tower for x, tower for y): one module twice, or the two encoders of a TwoTower."""
    model = TwoTower(dim_x=12, dim_y=12, hidden=24, dropout=0.3, seed=5)
    return (model.encoder_x, model.encoder_x) if shared else (model.encoder_x, model.encoder_y)


def data():
    return paired_data(N, dim_x=12, dim_y=12, seed=6)


def _ddp_grad_cache(rt, shared):
    tx, ty = towers(shared)
    wrapped = {id(t): DDP(copy.deepcopy(t)) for t in (tx, ty)}  # one DDP per distinct module
    models = [wrapped[id(tx)], wrapped[id(ty)]]
    counter = {"all_reduces": 0}

    def counting_hook(state, bucket):
        state["all_reduces"] += 1
        return default_hooks.allreduce_hook(None, bucket)

    for m in wrapped.values():
        m.register_comm_hook(counter, counting_hook)
    x, y = data()
    local = N // rt.world_size
    mine = x[rt.rank * local:(rt.rank + 1) * local], y[rt.rank * local:(rt.rank + 1) * local]
    results = {}
    for sync_last in (True, False):
        for m in wrapped.values():
            m.zero_grad(set_to_none=True)
        counter["all_reduces"] = 0
        torch.manual_seed(SEED + rt.rank)
        loss = GradCache(models, CHUNK, ddp_rep_clip_loss)(*mine, no_sync_except_last=sync_last)
        grads = {}
        for i, m in enumerate(wrapped.values()):
            grads.update(grads_of(m.module, prefix=f"tower{i}."))
        results[sync_last] = (grads, counter["all_reduces"], loss.item())
    return results


def global_reference(shared):
    tx, ty = towers(shared)
    copies = {id(t): copy.deepcopy(t) for t in (tx, ty)}
    x, y = data()
    local = N // P
    reps_x, reps_y = [], []
    for r in range(P):
        torch.manual_seed(SEED + r)
        reps_x += [copies[id(tx)](c) for c in x[r * local:(r + 1) * local].split(CHUNK)]
        reps_y += [copies[id(ty)](c) for c in y[r * local:(r + 1) * local].split(CHUNK)]
    loss = rep_clip_loss(torch.cat(reps_x), torch.cat(reps_y))
    loss.backward()
    grads = {}
    for i, m in enumerate(copies.values()):
        grads.update(grads_of(m, prefix=f"tower{i}."))
    return grads, loss.item()


@pytest.mark.parametrize("shared", [False, True], ids=["two towers", "one shared tower"])
def test_ddp_grad_cache_equals_the_global_batch_with_one_all_reduce(shared):
    per_rank = spawn(_ddp_grad_cache, P, shared)
    ref_grads, ref_loss = global_reference(shared)
    chunks = -(-(N // P) // CHUNK)  # 3
    distinct = 1 if shared else 2
    for sync_last, all_reduces in ((True, distinct), (False, 2 * chunks)):
        for grads, count, _ in (r[sync_last] for r in per_rank):
            assert all_ok(compare(ref_grads, grads))  # every rank holds the global gradient
            assert count == all_reduces  # one bucket per tower: one call per reducing backward
        mean_loss = sum(r[sync_last][2] for r in per_rank) / P
        assert abs(mean_loss - ref_loss) < 1e-10 * abs(ref_loss)


def test_the_ddp_check_would_catch_rank_local_negatives():
    """Guard: the seed's per-GPU loss (each rank's own C x C logits, no gather) differs from the
    global batch, so the comparison above can fail."""
    per_rank = spawn(_ddp_local_only, P)
    ref_grads, _ = global_reference(False)
    assert not all_ok(compare(ref_grads, per_rank[0]))


def _ddp_local_only(rt):
    tx, ty = towers(False)
    models = [DDP(copy.deepcopy(tx)), DDP(copy.deepcopy(ty))]
    x, y = data()
    local = N // rt.world_size
    torch.manual_seed(SEED + rt.rank)
    GradCache(models, CHUNK, rep_clip_loss)(x[rt.rank * local:(rt.rank + 1) * local],
                                            y[rt.rank * local:(rt.rank + 1) * local],
                                            no_sync_except_last=True)
    return {**grads_of(models[0].module, "tower0."), **grads_of(models[1].module, "tower1.")}


def _no_sync_without_ddp(rt):
    tx, ty = towers(False)
    try:
        GradCache([DDP(tx), ty], CHUNK, ddp_rep_clip_loss)(*data(), no_sync_except_last=True)
    except ValueError as err:
        return f"ValueError: {err}"
    return "no error"


def test_no_sync_except_last_on_a_plain_model_fails_on_every_rank():
    messages = spawn(_no_sync_without_ddp, P)
    assert len(set(messages)) == 1 and "model(s) [1] are not" in messages[0]


def test_memory_follows_the_chunk_not_the_batch():
    """PeakMemory of one step: GradCache at chunk 8 needs a fraction of plain autograd's peak at a batch
    of 128, and its peak hardly grows from 64 to 128 pairs while plain autograd's doubles. (Measured:
    plain 3.6 -> 7.1 MiB, GradCache 0.64 -> 0.66 MiB.)"""
    model = TwoTower(hidden=1024, dropout=0.1, seed=1)

    def peak(n, chunk=None):
        x, y = paired_data(n, seed=2)
        model.zero_grad(set_to_none=True)
        with PeakMemory() as mem:
            if chunk is None:
                rep_clip_loss(model.encoder_x(x), model.encoder_y(y)).backward()
            else:
                GradCache([model.encoder_x, model.encoder_y], chunk, rep_clip_loss)(x, y)
        return mem.peak_bytes

    plain_64, plain_128 = peak(64), peak(128)
    cache_64, cache_128 = peak(64, 8), peak(128, 8)
    assert cache_128 < plain_128 / 4
    assert plain_128 - plain_64 > 5 * (cache_128 - cache_64)
