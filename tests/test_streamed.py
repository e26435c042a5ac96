"""The streamed step's tensor math in one process, against autograd: the log-sum-exps a, b, the
closed-form G_x, G_y, dL/ds, float32 at tau = 0.01, the micro-batch split, and the config.

The reference is plain autograd on `clip_loss`, the symmetric InfoNCE through `cross_entropy` (no
streaming, no closed forms).
"""

import pytest
import torch
import torch.nn.functional as F

from distlab.contrastive.losses import clip_loss
from distlab.pieces.chunks import balanced_chunks
from distlab.proof.compare import all_ok, compare
from distlab.streamed.config import parse_config
from distlab.streamed.torch_tiles import streamed_lse, streamed_lse_both, streamed_softmax_pair_product


def closed_form(z_x, z_y, s, t):
    """Phases 2 and 3 on one process (P = 1, one micro-batch): a, b, G_x, G_y, dL/ds."""
    a, nll_x, b, nll_y = streamed_lse_both(z_x, z_y, s, t)
    coef, scale = torch.expm1(-nll_x) + torch.expm1(-nll_y), s / (2 * len(z_x))
    g_x = streamed_softmax_pair_product(z_x * s, z_y, a, b, coef, 0, t) * scale
    g_y = streamed_softmax_pair_product(z_y * s, z_x, b, a, coef, 0, t) * scale
    return a, b, g_x, g_y, (z_x * g_x).sum() / s


@pytest.mark.parametrize("t", [1, 5, 37, 100])  # T = 1, T not dividing N, T = N, T > N
@pytest.mark.parametrize("unit_norm", [True, False])
def test_closed_form_gradients_equal_autograd(t, unit_norm):
    gen = torch.Generator().manual_seed(t)
    z_x, z_y = (torch.randn(37, 6, generator=gen, dtype=torch.float64) for _ in range(2))
    if unit_norm:
        z_x, z_y = F.normalize(z_x, dim=1), F.normalize(z_y, dim=1)
    leaf_x, leaf_y = z_x.clone().requires_grad_(), z_y.clone().requires_grad_()
    s = torch.tensor(14.3, dtype=torch.float64, requires_grad=True)
    clip_loss(leaf_x, leaf_y, s).backward()
    a, b, g_x, g_y, g_s = closed_form(z_x, z_y, 14.3, t)
    logits = 14.3 * z_x @ z_y.T
    assert all_ok(
        compare(
            {"a": logits.logsumexp(1), "b": logits.logsumexp(0), "g_x": leaf_x.grad, "g_y": leaf_y.grad, "g_s": s.grad},
            {"a": a, "b": b, "g_x": g_x, "g_y": g_y, "g_s": g_s},
        )
    )
    # dL/ds from the other tower's rows is the same number (what a frozen x tower uses).
    assert torch.allclose((z_y * g_y).sum() / 14.3, s.grad, rtol=1e-10, atol=1e-12)
    lse, nll = streamed_lse(z_y[3:], z_x, 14.3, t, offset=3)  # rows 3.. of S^T: the sharded variant
    assert torch.allclose(lse, logits.logsumexp(0)[3:], rtol=1e-12, atol=0)
    assert torch.allclose(nll, -torch.log_softmax(logits.T, 1).diagonal()[3:], rtol=1e-10, atol=1e-13)


def test_the_kernel_check_catches_a_wrong_gradient():
    """G_x without its column-softmax half (one direction only) is visibly wrong: the check has teeth."""
    gen = torch.Generator().manual_seed(0)
    z_x, z_y = (torch.randn(10, 4, generator=gen, dtype=torch.float64) for _ in range(2))
    leaf_x = z_x.clone().requires_grad_()
    clip_loss(leaf_x, z_y, 2.0).backward()
    _, _, g_x, _, _ = closed_form(z_x, z_y, 2.0, 3)
    one_way = (torch.softmax(2.0 * z_x @ z_y.T, 1) @ z_y - z_y) * 2.0 / (2 * 10)
    assert all_ok(compare({"g": leaf_x.grad}, {"g": g_x}))
    assert not all_ok(compare({"g": leaf_x.grad}, {"g": one_way}))


@pytest.mark.parametrize("confidence", [0.0, 1.0, 3.0])  # loss ~65, ~0.5, ~2e-6 at tau = 0.01
def test_float32_at_tau_001_is_as_precise_as_autograd(confidence):
    """float32 against the float64 truth: within 1e-5 relative, and in the confident regime (positives
    far above the rest, nll ~1e-6) no worse than float32 autograd; the diagonal R_ii + Q_ii - 2 is
    where a naive a_i - S_ii (two numbers ~s = 100) would lose every digit."""
    gen = torch.Generator().manual_seed(1)
    z_x, z_y = (F.normalize(torch.randn(300, 16, generator=gen), dim=1) for _ in range(2))
    z_y = F.normalize(z_y + confidence * z_x, dim=1)
    truth = [z.double().requires_grad_() for z in (z_x, z_y)]
    clip_loss(*truth, 100.0).backward()
    f32 = [z.clone().requires_grad_() for z in (z_x, z_y)]
    clip_loss(*f32, 100.0).backward()
    _, _, g_x, g_y, _ = closed_form(z_x, z_y, 100.0, 64)
    for got, auto, ref in zip((g_x, g_y), f32, truth):
        ours = ((got.double() - ref.grad).abs().max() / ref.grad.abs().max()).item()
        theirs = ((auto.grad.double() - ref.grad).abs().max() / ref.grad.abs().max()).item()
        assert ours < max(1e-5, 2 * theirs), (ours, theirs)


@pytest.mark.parametrize("total, most", [(16, 5), (12, 5), (8, 5), (7, 7), (7, 100), (24, 1), (13, 4)])
def test_micro_batches_are_the_fewest_and_differ_by_at_most_one(total, most):
    parts = balanced_chunks(total, most)
    sizes = [p.stop - p.start for p in parts]
    assert sum(sizes) == total and parts[0].start == 0 and all(a.stop == b.start for a, b in zip(parts, parts[1:]))
    assert len(parts) == -(-total // most) and max(sizes) <= most and max(sizes) - min(sizes) <= 1
    if (total, most) == (16, 5):
        assert sizes == [4, 4, 4, 4]  # not 5, 5, 5, 1


def test_config_regimes_and_learnable_mode():
    base = {"GLOBAL_BATCH_SIZE": 24, "MICRO_BATCH_SIZE": 12, "STREAM_CHUNK_SIZE": 7}
    cfg = parse_config(base, 2, 1)
    assert cfg.tau is None and cfg.one_forward and cfg.local == 12 and cfg.offset == 12
    assert not parse_config(base | {"MICRO_BATCH_SIZE": 11, "TAU": 0.1}, 2, 0).one_forward
    for bad, match in (
        ({"TAU": 0.0}, "finite number > 0"),
        ({"STREAM_CHUNK": 3}, "did you mean"),
        ({"MICRO_BATCH_SIZE": True}, "must be an int"),
        ({"GLOBAL_BATCH_SIZE": 25}, "not divisible"),
    ):
        with pytest.raises(ValueError, match=match):
            parse_config(base | bad, 2, 0)
