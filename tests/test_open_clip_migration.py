"""What moving from open_clip_train changes, measured against the whole batch
(docs/distributed_clip.md's "Migrating from open_clip_train" section quotes these figures; `pytest -s` prints them).

open_clip's `ClipLoss` is re-implemented with every combination of its two flags (tests/open_clip_like.py
`open_clip_recipe`: its `gather_features`, then `ClipLoss.forward`) and run under DDP on the stock-like
CLIP at P = 2, 3, 4 (float64, N = 24, so open_clip's per-GPU `--batch-size` is N / P). Beside it, the
drop-in `ClipLoss` and `distributed_backward` with GLOBAL_BATCH_SIZE = that per-GPU batch times P. The
reference is plain autograd on the whole batch in one process (`clip_loss`). What holds:

- open_clip_train's default (neither `--local-loss` nor `--gather-with-grad`): every rank computes the
  whole N x N loss but back-propagates through its own features only, so DDP's average gives every
  encoder parameter exactly 1/P of the whole batch's gradient; the logit scale's, which every rank
  computes whole, is exact.
- `--local-loss` alone: each rank's C rows against features gathered without a gradient. A feature's
  gradient keeps only its own row's share, s/(2N) sum_j (R_ij - delta_ij) z_j^y for z_i^x, and loses the
  share the columns give it (the Q_ij terms, which reach it through every rank's rows): the same wrong
  direction at any P (its cosine to the true encoder gradient is printed); the scale's is exact.
- `--gather-with-grad` (with or without `--local-loss`), the drop-in `ClipLoss` and `distributed_backward`:
  exact (rtol 1e-10). open_clip's local loss differs from rank to rank (their mean is L); the drop-in's is
  L on every rank.
"""

import math

import pytest
import torch
from open_clip_like import CLIP, image_text_data, open_clip_recipe
from torch.nn.parallel import DistributedDataParallel as DDP

from distlab.contrastive.losses import clip_loss
from distlab.contrastive.reference import full_batch_gradients
from distlab.processes.spawn import spawn
from distlab.proof.compare import all_ok, compare
from distributed_clip import ClipLoss, distributed_backward

N = 24
RECIPES = {  # label -> open_clip's (local_loss, gather_with_grad)
    "open_clip default": (False, False),
    "--local-loss": (True, False),
    "--gather-with-grad": (False, True),
    "--local-loss --gather-with-grad": (True, True),
}


def grads(model):
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def every_way(rt):
    batch_size = N // rt.world_size  # open_clip's --batch-size: per GPU
    images, texts = (t[rt.rank * batch_size : (rt.rank + 1) * batch_size] for t in image_text_data(N))
    out = {}
    for label, flags in RECIPES.items():
        model = CLIP()
        ddp = DDP(model)
        loss = open_clip_recipe(*ddp(images, texts), *flags)
        loss.backward()
        out[label] = (loss.item(), grads(model))
    model = CLIP()
    ddp = DDP(model)
    loss = ClipLoss(rank=rt.rank, world_size=rt.world_size)(*ddp(images, texts))
    loss.backward()
    out["drop-in ClipLoss"] = (loss.item(), grads(model))
    model = CLIP()
    config = {"GLOBAL_BATCH_SIZE": batch_size * rt.world_size, "MICRO_BATCH_SIZE": batch_size, "STREAM_CHUNK_SIZE": 8}
    out["distributed_backward"] = (distributed_backward(DDP(model), images, texts, config), grads(model))
    return out


def cosine(got, ref, names):
    a, b = (torch.cat([g[k].reshape(-1) for k in names]) for g in (got, ref))
    return (a @ b / (a.norm() * b.norm())).item()


@pytest.mark.parametrize("world", [2, 3, 4])
def test_what_each_open_clip_recipe_gives_against_the_whole_batch(world):
    results = spawn(every_way, world, timeout_s=60)
    ref_loss, ref = full_batch_gradients(CLIP(), *image_text_data(N), None, clip_loss)
    encoders = [k for k in ref if k != "logit_scale"]
    scale_only = {"logit_scale": ref["logit_scale"]}
    for r in results:
        default, local_only = r["open_clip default"][1], r["--local-loss"][1]
        ratios = [(default[k] * ref[k]).sum().item() / (ref[k] * ref[k]).sum().item() for k in encoders]
        assert all(math.isclose(v, 1 / world, rel_tol=1e-9) for v in ratios), ratios  # 1/P, every tensor
        assert all_ok(compare({k: ref[k] / world for k in encoders}, {k: default[k] for k in encoders}))
        assert all_ok(compare(scale_only, {"logit_scale": default["logit_scale"]}))  # the scale's: exact
        assert all_ok(compare(scale_only, {"logit_scale": local_only["logit_scale"]}))
        local_cosine = cosine(local_only, ref, encoders)
        assert local_cosine < 0.99, local_cosine  # --local-loss alone: another direction
        for label in (
            "--gather-with-grad",
            "--local-loss --gather-with-grad",
            "drop-in ClipLoss",
            "distributed_backward",
        ):
            assert all_ok(compare(ref, r[label][1])), (world, label)
        for label in ("drop-in ClipLoss", "distributed_backward"):
            assert math.isclose(r[label][0], ref_loss, rel_tol=1e-10), (label, r[label][0], ref_loss)
    local_losses = [r["--local-loss --gather-with-grad"][0] for r in results]
    assert len(set(local_losses)) == world and math.isclose(sum(local_losses) / world, ref_loss, rel_tol=1e-10)
    print(
        f"\nP = {world}: open_clip default, encoder gradient / true = {sum(ratios) / len(ratios):.4f} (1/P = "
        f"{1 / world:.4f}), logit scale exact; --local-loss alone: cosine to the true encoder gradient "
        f"{local_cosine:.3f}; open_clip's local losses {', '.join(f'{v:.4f}' for v in local_losses)} "
        f"(mean {sum(local_losses) / world:.4f}), the drop-in's {results[0]['drop-in ClipLoss'][0]:.4f} on every rank"
    )
