"""`distlab.streamed.own_block` against the dense one-process reference, float64: a rank's own block of S made once
gives its rows' and columns' LSEs and nlls and its G_x, G_y to 1e-12, with the block first, in the middle, last,
or the whole batch, and tiles that do not divide it. The check can fail: a twin merge that grows the LSE by the other
columns but leaves the nll at the block's is rejected."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from distlab.streamed.kernel_choice import TorchTiles
from distlab.streamed.own_block import block_pair_products, merged, others, own_lse

S_SCALE = 7.0
CASES = [
    (24, slice(8, 16), 5),
    (24, slice(0, 8), 5),
    (24, slice(16, 24), 5),
    (30, slice(13, 17), 4),
    (12, slice(0, 12), 5),
]


def _batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(n)
    z_x = F.normalize(torch.randn(n, 6, generator=gen, dtype=torch.float64), dim=1)
    z_y = F.normalize(z_x + torch.randn(n, 6, generator=gen, dtype=torch.float64), dim=1)
    return z_x, z_y


def _reference(z_x, z_y):
    """Plain dense math: a, b, the nlls and W = R + Q - 2 I of S = s Z_x Z_y^T."""
    s = S_SCALE * z_x @ z_y.T
    a, b, diag = s.logsumexp(1), s.logsumexp(0), s.diagonal()
    w = (s - a[:, None]).exp() + (s - b[None, :]).exp() - 2 * torch.eye(len(s), dtype=s.dtype)
    return a, b, a - diag, b - diag, w


@pytest.mark.parametrize("n, own, t", CASES)
def test_the_own_block_once_equals_the_dense_reference(n, own, t):
    z_x, z_y = _batch(n)
    a, b, nll_x, nll_y, w = _reference(z_x, z_y)
    got = own_lse(z_x, z_y, S_SCALE, own, TorchTiles(t))
    for mine, want in zip(got, (a[own], nll_x[own], b[own], nll_y[own])):
        torch.testing.assert_close(mine, want, rtol=0, atol=1e-12)
    coef = torch.expm1(-nll_x[own]) + torch.expm1(-nll_y[own])
    g_x, g_y = block_pair_products(z_x, z_y, S_SCALE, (a, b), coef, own, TorchTiles(t))
    torch.testing.assert_close(g_x, w[own] @ z_y, rtol=0, atol=1e-12)
    torch.testing.assert_close(g_y, w[:, own].T @ z_x, rtol=0, atol=1e-12)


def _merge_forgetting_the_nll(lse, nll, rest):
    """A wrong twin of `merged`: the rest of the row grows the LSE but not the nll (lse - S_ii moves with it)."""
    return merged(lse, nll, rest)[0], nll


def test_a_merge_that_leaves_the_nll_at_the_block_s_is_rejected():
    z_x, z_y = _batch(24)
    own, ops = slice(8, 16), TorchTiles(5)
    _, _, nll_x, _, _ = _reference(z_x, z_y)
    lse, nll, *_ = ops.both_lse(z_x[own], z_y[own], S_SCALE)
    rest = [ops.row_lse(z_x[own], z_y[cols], S_SCALE, own.start - cols.start)[0] for cols in others(own, 24)]
    torch.testing.assert_close(merged(lse, nll, rest)[1], nll_x[own], rtol=0, atol=1e-12)
    assert not torch.allclose(_merge_forgetting_the_nll(lse, nll, rest)[1], nll_x[own], rtol=0, atol=1e-6)
