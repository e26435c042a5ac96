"""The Triton kernels, one at a time, under Triton's CPU interpreter, against plain autograd on the whole S.

q of 21 rows against k of 45, d = 19 (no side a multiple of a block, d not a power of two), with 16 x 16 x 16
blocks and three column ranges (every edge crossed, the ranges' partials merged), and in float64 with the default
blocks (`kernel_helpers.CASES`): phase 2's row fold (and its column partials), phase 3's product
sum_j (R + Q - 2 delta)_ij k_j, the sigmoid's D k and sums. Float64 to 1e-10 (relative), float32 to 1e-5; bf16
(MATMUL_PRECISION) against plain autograd under bf16 autocast. A positive read from the wrong column is caught
(the check can fail).
"""

import kernel_helpers  # noqa: F401 - sets TRITON_INTERPRET=1 before the kernels are imported
import pytest
import torch
import torch.nn.functional as F
from kernel_helpers import CASES, IDS, relative

from distlab.contrastive.losses import clip_loss
from distlab.streamed.kernels import coefficients, product
from distlab.streamed.kernels.lse import row_lse
from distlab.streamed.torch_tiles import Pairing, lse_and_nll

ROWS, COLS, D, OFFSET, SCALE = 21, 45, 19, 7, 3.0
TOL = {torch.float64: 1e-10, torch.float32: 1e-5}

PATHS = [product, coefficients]  # W in registers (KERNELS "triton"), W in memory ("triton-mm")


def embeddings(dtype, n_q=ROWS, n_k=COLS, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (F.normalize(torch.randn(n, D, generator=gen, dtype=torch.float64), dim=1) for n in (n_q, n_k))
    return q.to(dtype), k.to(dtype)


@pytest.mark.parametrize("dtype, blocks", CASES, ids=IDS)
def test_row_fold_equals_logsumexp(dtype, blocks):
    q, k = embeddings(dtype)
    folded = row_lse(q, k, SCALE, OFFSET, "float32", columns=True, blocks=blocks)
    lse, nll = lse_and_nll(folded.m, folded.l, folded.diag)
    s = SCALE * q.double() @ k.double().T
    rows = torch.arange(ROWS)
    assert relative(lse, s.logsumexp(1)) <= TOL[dtype]
    assert relative(nll, s.logsumexp(1) - s[rows, rows + OFFSET]) <= TOL[dtype]
    assert relative(folded.col_m + folded.col_l.log(), s.logsumexp(0)) <= TOL[dtype]
    wrong = row_lse(q, k, SCALE, OFFSET + 1, "float32", blocks=blocks)  # the positive one column off
    assert relative(lse_and_nll(wrong.m, wrong.l, wrong.diag)[1], nll) > 1e-2


def infonce_truth(z_x, z_y, scale):
    """dL/dZ_x, dL/dZ_y of the symmetric InfoNCE by plain autograd over the whole S (float64)."""
    z_x, z_y = (z.detach().double().clone().requires_grad_() for z in (z_x, z_y))  # never the caller's tensors
    clip_loss(z_x, z_y, scale).backward()
    return z_x.grad, z_y.grad


@pytest.mark.parametrize("dtype, blocks", CASES, ids=IDS)
@pytest.mark.parametrize("path", PATHS, ids=["fused", "mm"])
def test_pair_product_is_the_infonce_gradient(path, dtype, blocks):
    """G_x = s/(2N) sum_j (R + Q - 2 delta)_ij z_j^y for rows OFFSET.. of Z_x, and G_y by the swapped roles."""
    z_x, z_y = embeddings(dtype, COLS, COLS)
    n, own = COLS, slice(OFFSET, OFFSET + ROWS)
    s = SCALE * z_x.double() @ z_y.double().T
    a, b = s.logsumexp(1), s.logsumexp(0)
    diag = s.diagonal()
    coef = torch.expm1(diag - a) + torch.expm1(diag - b)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    a, b, coef = a.to(acc), b.to(acc), coef.to(acc)
    out_scale = SCALE / (2 * n)
    g_x = path.pair_product(z_x[own], z_y, SCALE, Pairing(a[own], b, coef[own], OFFSET), "float32", out_scale, blocks)
    g_y = path.pair_product(z_y[own], z_x, SCALE, Pairing(b[own], a, coef[own], OFFSET), "float32", out_scale, blocks)
    truth_x, truth_y = infonce_truth(z_x, z_y, SCALE)
    assert relative(g_x, truth_x[own]) <= TOL[dtype] and relative(g_y, truth_y[own]) <= TOL[dtype]
    off = path.pair_product(z_x[own], z_y, SCALE, Pairing(a[own], b, coef[own], OFFSET - 1), "float32", SCALE / (2 * n))
    assert relative(off, truth_x[own]) > 1e-2  # the positives' coefficients on the wrong columns


@pytest.mark.parametrize("dtype, blocks", CASES, ids=IDS)
@pytest.mark.parametrize("path", PATHS, ids=["fused", "mm"])
def test_sigmoid_rows_are_the_sigmoid_gradient(path, dtype, blocks):
    """D z_y s = dL/dZ_x for rows OFFSET.. (their positives at columns OFFSET..), the loss and dL/dbeta,
    with logits in the tens (s = 10, beta = -10, SigLIP's start) and in the hundreds (s = 300)."""
    for s, beta in ((10.0, -10.0), (300.0, 5.0)):
        z_x, z_y = embeddings(dtype, COLS, COLS)
        own = slice(OFFSET, OFFSET + ROWS)
        zx, zy = z_x.double().requires_grad_(), z_y.double().requires_grad_()
        bias = torch.tensor(beta, dtype=torch.float64, requires_grad=True)
        logits = s * zx @ zy.T + bias
        eps = 2 * torch.eye(COLS, dtype=torch.float64) - 1
        loss = -F.logsigmoid(eps * logits).sum() / COLS
        loss.backward()
        d_k, loss_sum, d_sum = path.sigmoid_rows(z_x[own], z_y, (s, beta), COLS, OFFSET, "float32", blocks)
        part = -F.logsigmoid(eps * logits)[own].sum()
        assert relative(d_k * s, zx.grad[own]) <= TOL[dtype]
        assert abs(loss_sum.item() - part.item()) <= TOL[dtype] * part.item()
        d_rows = torch.autograd.grad(-F.logsigmoid(eps * (s * zx @ zy.T + bias))[own].sum() / COLS, bias)[0]
        assert abs(d_sum.item() - d_rows.item()) <= TOL[dtype] * abs(d_rows.item())


@pytest.mark.parametrize("dtype, blocks", CASES, ids=IDS)
def test_one_w_for_both_products_is_both_gradients(dtype, blocks):
    """W in memory, both products from one W (the rings' visits): the rows' and the columns' gradients of the
    whole batch, InfoNCE (G_x, G_y) and sigmoid (dL/dZ_x, dL/dZ_y, the loss, dL/dbeta), W made 5 rows at a time."""
    z_x, z_y = embeddings(dtype, COLS, COLS)
    n, acc = COLS, torch.float64 if dtype == torch.float64 else torch.float32
    s = SCALE * z_x.double() @ z_y.double().T
    a, b, diag = s.logsumexp(1), s.logsumexp(0), s.diagonal()
    coef = torch.expm1(diag - a) + torch.expm1(diag - b)
    pairing = Pairing(a.to(acc), b.to(acc), coef.to(acc), 0)
    g_x, g_y = coefficients.pair_products(z_x, z_y, SCALE, pairing, "float32", SCALE / (2 * n), blocks)
    truth_x, truth_y = infonce_truth(z_x, z_y, SCALE)
    assert relative(g_x, truth_x) <= TOL[dtype] and relative(g_y, truth_y) <= TOL[dtype]
    zx, zy = (z.detach().double().clone().requires_grad_() for z in (z_x, z_y))  # not z_x itself in float64
    bias = torch.tensor(-10.0, dtype=torch.float64, requires_grad=True)
    eps = 2 * torch.eye(n, dtype=torch.float64) - 1
    loss = -F.logsigmoid(eps * (10.0 * zx @ zy.T + bias)).sum() / n
    loss.backward()
    d_k, d_q, loss_sum, d_sum = coefficients.sigmoid_rows_and_columns(z_x, z_y, (10.0, -10.0), n, 0, "float32", blocks)
    assert relative(d_k * 10.0, zx.grad) <= TOL[dtype] and relative(d_q * 10.0, zy.grad) <= TOL[dtype]
    assert abs(loss_sum.item() / n - loss.item()) <= TOL[dtype] * loss.item()
    assert abs(d_sum.item() - bias.grad.item()) <= TOL[dtype] * abs(bias.grad.item())


@pytest.mark.parametrize("path", PATHS, ids=["fused", "mm"])
def test_bf16_matmul_precision_is_within_plain_autograd_under_autocast(path):
    """bf16 embeddings, MATMUL_PRECISION "bf16": the rows' G against the float64 truth for the same bf16
    embeddings, beside plain autograd under bf16 autocast (its logits rounded to bf16)."""
    z_x, z_y = embeddings(torch.bfloat16, COLS, COLS)
    n = COLS
    truth_x, _ = infonce_truth(z_x, z_y, SCALE)
    s = SCALE * z_x.double() @ z_y.double().T
    a, b = s.logsumexp(1).float(), s.logsumexp(0).float()
    coef = (torch.expm1(s.diagonal() - s.logsumexp(1)) + torch.expm1(s.diagonal() - s.logsumexp(0))).float()
    g_x = path.pair_product(z_x, z_y, SCALE, Pairing(a, b, coef, 0), "bf16", SCALE / (2 * n))
    zx, zy = z_x.clone().requires_grad_(), z_y.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        clip_loss(zx, zy, SCALE).backward()
    ours, plain = relative(g_x, truth_x), relative(zx.grad, truth_x)
    print(f"bf16: the kernel's G_x {ours:.1e} from the truth, plain autograd under autocast {plain:.1e}")
    assert ours <= plain
