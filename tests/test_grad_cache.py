"""GradCache in one process: the gradients of the full batch, whatever the input and the chunking.

The reference is a deep copy trained with plain autograd on the whole batch. With dropout on, it runs
the batch through the model in the same chunks, in the same order, from the same seed (that is what
fixes the masks) but with a graph, in one backward of one loss: no cache, no RandContext, no second
pass. Float64 throughout (rtol 1e-10, atol 1e-12) unless a test states otherwise.
"""

import pytest
import torch
from grad_cache_helpers import SEED, N, Output, grads_of_models, image_batch, reference, rep_clip_loss, rows
from torch import nn

import distlab.contrastive.grad_cache as grad_cache_module
from distlab.contrastive.grad_cache import GradCache, default_rep
from distlab.pieces.split_inputs import split_inputs
from distlab.proof.compare import all_ok, compare
from distlab.proof.models import TwoTower, paired_data

# --- tensors and lists, one and two models ----------------------------------------------------------


@pytest.mark.parametrize("chunk", [1, 4, 5, N])  # 4 and 5 do not divide 13; 13 is one chunk
@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_two_towers_equal_the_full_batch(chunk, dropout):
    model = TwoTower(dropout=dropout, seed=1)
    models = [model.encoder_x, model.encoder_y]
    x, y = paired_data(N, seed=2)
    chunked = [rows(x, chunk), rows(y, chunk)] if dropout else None
    ref_grads, ref_loss = reference(models, [x, y], rep_clip_loss, chunked)

    torch.manual_seed(SEED)
    loss = GradCache(models, chunk, rep_clip_loss)(x, y)
    assert all_ok(compare(ref_grads, grads_of_models(models)))
    assert torch.allclose(loss, ref_loss, rtol=1e-10, atol=0)


def test_one_shared_tower_with_a_chunk_size_per_side_and_list_inputs():
    tower = TwoTower(dim_x=12, dim_y=12, dropout=0.3, seed=1).encoder_x
    x, y = paired_data(N, dim_x=12, dim_y=12, seed=2)
    ref_grads, ref_loss = reference([tower, tower], [x, y], rep_clip_loss, [rows(x, 3), rows(y, 5)])

    torch.manual_seed(SEED)
    loss = GradCache([tower, tower], [3, 5], rep_clip_loss)([x], [y])  # model(*[x]): the list path
    assert all_ok(compare(ref_grads, grads_of_models([tower])))
    assert torch.allclose(loss, ref_loss, rtol=1e-10, atol=0)


def test_without_rand_context_dropout_gradients_are_wrong(monkeypatch):
    """Why RandContext exists: the recompute draws fresh masks, so its gradient is of another function."""

    class NoReplay:
        def __init__(self, *inputs):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return None

    monkeypatch.setattr(grad_cache_module, "RandContext", NoReplay)
    for dropout, expect_ok in ((0.0, True), (0.3, False)):
        model = TwoTower(dropout=dropout, seed=1)
        models = [model.encoder_x, model.encoder_y]
        x, y = paired_data(N, seed=2)
        ref_grads, ref_loss = reference(models, [x, y], rep_clip_loss, [rows(x, 4), rows(y, 4)])
        torch.manual_seed(SEED)
        loss = GradCache(models, 4, rep_clip_loss)(x, y)
        assert torch.allclose(loss, ref_loss)  # the loss is right either way: only gradients show it
        result = compare(ref_grads, grads_of_models(models))
        assert all_ok(result) == expect_ok
        if not expect_ok:
            assert max(r.max_rel for r in result) > 1e-2  # not a rounding error: a different function


# --- mixed precision ------------------------------------------------------------------------------------

# Stated tolerances, max |a - r| / max |r| per gradient tensor against float32 plain autograd: float16
# keeps 11 significant bits (~5e-4 relative per rounding), bfloat16 8 bits (~4e-3); the errors of a
# few matmuls add up to some 1e-3 and 1e-2. Measured here (torch 2.13, CPU): fp16 8.6e-4, bf16 9.4e-3
# for the gradients; 3e-5 and 6e-5 for the loss (computed in float32 from the low-precision reps).
MIXED_TOLERANCE = {"fp16": 5e-3, "bf16": 3e-2}


@pytest.mark.parametrize("mode", ["fp16", "bf16"])
def test_mixed_precision_stays_close_to_float32(mode):
    model = TwoTower(hidden=64, embed_dim=16, dropout=0.1, seed=1, dtype=torch.float32)
    models = [model.encoder_x, model.encoder_y]
    x, y = paired_data(64, seed=2, dtype=torch.float32)
    ref_grads, ref_loss = reference(models, [x, y], rep_clip_loss, [rows(x, 16), rows(y, 16)])

    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12) if mode == "fp16" else None
    cache = GradCache(models, 16, rep_clip_loss, precision=mode, scaler=scaler)
    torch.manual_seed(SEED)
    loss = cache(x, y)
    grads = grads_of_models(models)
    if scaler is not None:  # the gradients are of the scaled loss, as with any GradScaler
        grads = {n: g / scaler.get_scale() for n, g in grads.items()}
    assert all(torch.isfinite(g).all() for g in grads.values())
    worst = max(r.max_rel for r in compare(ref_grads, grads, rtol=0, atol=0))
    assert worst < MIXED_TOLERANCE[mode], f"{mode}: max relative gradient error {worst:.2e}"
    assert abs(loss.item() - ref_loss.item()) < MIXED_TOLERANCE[mode] * ref_loss.item()
    assert worst > 1e-6  # it really ran in low precision (float32 would agree to ~1e-7)


def test_fp16_scaler_step_trains_like_float32():
    """The caller's usual AMP step works on GradCache's scaled gradients."""
    model = TwoTower(hidden=64, seed=1, dtype=torch.float32)
    models = [model.encoder_x, model.encoder_y]
    x, y = paired_data(64, seed=2, dtype=torch.float32)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    scaler = torch.amp.GradScaler("cpu")
    cache = GradCache(models, 16, rep_clip_loss, precision="fp16", scaler=scaler)
    losses = []
    for _ in range(5):
        optimizer.zero_grad()
        losses.append(cache(x, y).item())
        scaler.step(optimizer)
        scaler.update()
    assert losses[-1] < losses[0]


# --- representations and bad input --------------------------------------------------------------------


def test_representations_are_found_without_tensor_truthiness():
    """`a or b` on tensors raises (a tensor has no truth value); every lookup here is `is None`."""
    pooled, hidden = torch.randn(4, 3), torch.randn(4, 5, 3)
    assert default_rep(Output(hidden, pooled)) is pooled
    assert torch.equal(default_rep(Output(hidden, None)), hidden[:, 0])
    assert torch.equal(default_rep({"pooler_output": None, "last_hidden_state": hidden}), hidden[:, 0])
    assert default_rep((pooled, hidden)) is pooled


def _bad(**kw):
    model = TwoTower()
    settings = dict(models=[model.encoder_x, model.encoder_y], chunk_sizes=4, loss_fn=rep_clip_loss)
    return GradCache(**{**settings, **kw})


x13, y13 = paired_data(N)
BAD_INPUT = {
    "chunk sizes for three models, two models": (lambda: _bad(chunk_sizes=[4, 4, 4]), "3 entries for 2 models"),
    "chunk size zero": (lambda: _bad(chunk_sizes=0), "positive int"),
    "chunk size True": (lambda: _bad(chunk_sizes=[4, True]), "positive int"),
    "a bare module": (lambda: _bad(models=TwoTower().encoder_x), "non-empty list of modules"),
    "fp16 without scaler": (lambda: _bad(precision="fp16"), "needs a GradScaler"),
    "scaler without fp16": (lambda: _bad(scaler=torch.amp.GradScaler("cpu")), 'only used with precision="fp16"'),
    "bf16 with a scaler": (lambda: _bad(precision="bf16", scaler=torch.amp.GradScaler("cpu")), "bf16 needs no"),
    "an unknown precision": (lambda: _bad(precision="fp8"), "precision must be one of"),
    "one input for two models": (lambda: _bad()(x13), "1 inputs for 2 models"),
    "no_sync_except_last without DDP": (
        lambda: _bad()(x13, y13, no_sync_except_last=True),
        r"DistributedDataParallel; model\(s\) \[0, 1\]",
    ),
    "a string input": (lambda: _bad()("thirteen pairs", y13), "type str"),
    "a set input": (lambda: _bad()({x13}, y13), "type set"),
    "a dict holding a list": (lambda: _bad()({"x": [1, 2]}, y13), r"\['x'\] is of type list"),
    "dict values of unequal length": (lambda: _bad()({"a": x13, "b": x13[:5]}, y13), "disagree on the batch size"),
    "patches that do not add up": (
        lambda: split_inputs({**image_batch(4, 0), "pixel_values": torch.zeros(3, 5)}, 2),
        "patch rows but image_grid_thw describes",
    ),
    "two images for one sample": (
        lambda: split_inputs(
            {**image_batch(4, 0), "input_ids": torch.zeros(2, 3), "attention_mask": torch.ones(2, 3)}, 2
        ),
        "4 rows for 2 samples: one image per sample",
    ),
    "a model returning a string": (
        lambda: GradCache([_Str(), _Str()], 4, rep_clip_loss)(x13, y13),
        "representation must be a tensor",
    ),
    "a loss that is not a scalar": (lambda: _bad(loss_fn=lambda a, b: a - b)(x13, y13), "scalar tensor"),
}


class _Str(nn.Module):
    def forward(self, x):
        return "not a tensor"


@pytest.mark.parametrize("case", BAD_INPUT, ids=list(BAD_INPUT))
def test_bad_input_gets_a_clear_error(case):
    make, message = BAD_INPUT[case]
    with pytest.raises(ValueError, match=message):
        make()
