"""S in memory (KERNELS "triton-s", `distlab.streamed.kernels.s_in_memory`) under Triton's CPU interpreter,
against plain autograd on the whole S and against the torch tiles.

Each S chunk is made by a GEMM and read by one Triton pass: the fold (rows' and columns' log-sum-exps), or W
written over S in place and both products from it (InfoNCE; the sigmoid with its loss and dL/dbeta). q of 21
rows against k of 45, d = 19, with 16 x 16 tiles, three column ranges and S in chunks of 5 rows (a chunk cuts
through a block of rows; the columns' partials of the chunks merged), and with the default blocks. Then rings
of P ranks of C = 5 pairs (N = P C, no side a multiple of a tile; the InfoNCE at P = 1, 3, 8 in float64 and 2
in float32, the sigmoid at P = 3) simulated in one process, visit by visit as `ring.infonce_ring` and
`ring.sigmoid_ring` walk them: the gradients equal plain autograd and the torch tiles; where the budget holds
pass 1's S, pass 2 takes it back (half the GEMMs of S) with the same numbers to the bit. Float64 to 1e-10,
float32 to 1e-5; bf16 W (written into S's own bytes) within plain autograd under autocast. A positive read one
column off is caught.
"""

from functools import reduce

import kernel_helpers  # noqa: F401 - sets TRITON_INTERPRET=1 before the kernels are imported
import pytest
import torch
import torch.nn.functional as F
from kernel_helpers import CASES, IDS, SMALL_BLOCKS, relative

from distlab.contrastive.losses import clip_loss
from distlab.pieces.online_softmax import merge
from distlab.streamed.kernel_choice import TorchTiles, TritonTiles
from distlab.streamed.kernels import s_in_memory
from distlab.streamed.kernels.coefficients import infonce_job, sigmoid_job
from distlab.streamed.sigmoid import Logits
from distlab.streamed.torch_tiles import Pairing, RowFold, lse_and_nll

ROWS, COLS, D, OFFSET, SCALE = 21, 45, 19, 7, 3.0
TOL = {torch.float64: 1e-10, torch.float32: 1e-5}


def embeddings(dtype, n_q=ROWS, n_k=COLS, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (F.normalize(torch.randn(n, D, generator=gen, dtype=torch.float64), dim=1) for n in (n_q, n_k))
    return q.to(dtype), k.to(dtype)


def infonce_truth(z_x, z_y, scale):
    z_x, z_y = (z.detach().double().clone().requires_grad_() for z in (z_x, z_y))
    clip_loss(z_x, z_y, scale).backward()
    return z_x.grad, z_y.grad


def sigmoid_truth(z_x, z_y, s, beta):
    """(loss, dL/dZ_x, dL/dZ_y, dL/dbeta) of SigLIP's loss over the whole S by plain autograd (float64)."""
    zx, zy = (z.detach().double().clone().requires_grad_() for z in (z_x, z_y))
    bias = torch.tensor(beta, dtype=torch.float64, requires_grad=True)
    eps = 2 * torch.eye(len(zx), dtype=torch.float64) - 1
    loss = -F.logsigmoid(eps * (s * zx @ zy.T + bias)).sum() / len(zx)
    loss.backward()
    return loss.item(), zx.grad, zy.grad, bias.grad.item()


@pytest.mark.parametrize("dtype, blocks", CASES, ids=IDS)
def test_the_fold_of_s_in_memory_is_the_logsumexp(dtype, blocks):
    q, k = embeddings(dtype)
    folded = s_in_memory.row_lse(q, k, SCALE, OFFSET, "float32", True, s_in_memory.Chunking(blocks))
    lse, nll = lse_and_nll(folded.m, folded.l, folded.diag)
    s = SCALE * q.double() @ k.double().T
    assert relative(lse, s.logsumexp(1)) <= TOL[dtype]
    assert relative(nll, s.logsumexp(1) - s[torch.arange(ROWS), torch.arange(ROWS) + OFFSET]) <= TOL[dtype]
    assert relative(folded.col_m + folded.col_l.log(), s.logsumexp(0)) <= TOL[dtype]
    wrong = s_in_memory.row_lse(q, k, SCALE, OFFSET + 1, "float32", False, s_in_memory.Chunking(blocks))  # one off
    assert relative(lse_and_nll(wrong.m, wrong.l, wrong.diag)[1], nll) > 1e-2


@pytest.mark.parametrize("dtype, blocks", CASES, ids=IDS)
def test_w_over_s_gives_both_gradients_of_both_losses(dtype, blocks):
    """One W written over each chunk of S feeds both products: the InfoNCE's G_x, G_y and the sigmoid's dL/dZ_x,
    dL/dZ_y, loss and dL/dbeta (s = 10, beta = -10), all of the whole batch."""
    z_x, z_y = embeddings(dtype, COLS, COLS)
    n, acc = COLS, torch.float64 if dtype == torch.float64 else torch.float32
    s = SCALE * z_x.double() @ z_y.double().T
    a, b, diag = s.logsumexp(1), s.logsumexp(0), s.diagonal()
    coef = torch.expm1(diag - a) + torch.expm1(diag - b)
    job = infonce_job(SCALE, Pairing(a.to(acc), b.to(acc), coef.to(acc), 0), SCALE / (2 * n), True)
    g_x, g_y, _, _ = s_in_memory.run(z_x, z_y, job, "float32", blocks)
    truth_x, truth_y = infonce_truth(z_x, z_y, SCALE)
    assert relative(g_x, truth_x) <= TOL[dtype] and relative(g_y, truth_y) <= TOL[dtype]
    off = infonce_job(SCALE, Pairing(a.to(acc), b.to(acc), coef.to(acc), 1), SCALE / (2 * n), False)
    assert relative(s_in_memory.run(z_x, z_y, off, "float32", blocks)[0], truth_x) > 1e-2
    loss, gx, gy, gb = sigmoid_truth(z_x, z_y, 10.0, -10.0)
    d_k, d_q, loss_rows, d_rows = s_in_memory.run(
        z_x, z_y, sigmoid_job(z_x, (10.0, -10.0), n, 0, True), "float32", blocks
    )
    assert relative(d_k * 10.0, gx) <= TOL[dtype] and relative(d_q * 10.0, gy) <= TOL[dtype]
    assert abs(loss_rows.sum().item() / n - loss) <= TOL[dtype] * loss
    assert abs(d_rows.sum().item() - gb) <= TOL[dtype] * abs(gb)


def test_bf16_w_in_the_bytes_of_s_is_within_autocast():
    """MATMUL_PRECISION "bf16": W rounded to bf16 and written into the first half of each float32 row of S (a
    bf16 view of row stride 2 n_k, read by the products as it is): G_x against the float64 truth for the same
    bf16 embeddings, no further than plain autograd under bf16 autocast."""
    z_x, z_y = embeddings(torch.bfloat16, COLS, COLS)
    n = COLS
    truth_x, _ = infonce_truth(z_x, z_y, SCALE)
    s = SCALE * z_x.double() @ z_y.double().T
    a, b = s.logsumexp(1), s.logsumexp(0)
    coef = torch.expm1(s.diagonal() - a) + torch.expm1(s.diagonal() - b)
    job = infonce_job(SCALE, Pairing(a.float(), b.float(), coef.float(), 0), SCALE / (2 * n), False)
    g_x = s_in_memory.run(z_x, z_y, job, "bf16", SMALL_BLOCKS)[0]
    zx, zy = z_x.clone().requires_grad_(), z_y.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        clip_loss(zx, zy, SCALE).backward()
    ours, plain = relative(g_x, truth_x), relative(zx.grad, truth_x)
    print(f"bf16: G_x from W over S {ours:.1e} from the truth, plain autograd under autocast {plain:.1e}")
    assert ours <= plain


def infonce_ring_in_one_process(x, y, scale, ops_of):
    """The InfoNCE ring of P = len(x) ranks, visit by visit as `ring.infonce_ring` walks it (rank r at step k
    visits block (r - k) mod P), every rank's pass 1 before any pass 2; ops_of(r): rank r's tile ops."""
    world, c = len(x), len(x[0])
    ops = [ops_of(r) for r in range(world)]
    kw = dict(dtype=x[0].dtype)
    folds = [RowFold(torch.full((c,), float("-inf"), **kw), torch.zeros(c, **kw), torch.empty(c, **kw),
                     torch.empty(c, **kw)) for _ in range(world)]  # fmt: skip
    cols = [[] for _ in range(world)]
    for r in range(world):
        for step in range(world):
            j = (r - step) % world
            cols[j].append(ops[r].ring_fold(x[r], y[j], scale, folds[r], j == r))
    b_nll = [lse_and_nll(*reduce(merge_pairs, parts), folds[j].diag_cols) for j, parts in enumerate(cols)]
    g_x, g_y = [torch.zeros_like(x[0]) for _ in range(world)], [torch.zeros_like(x[0]) for _ in range(world)]
    for r in range(world):
        a, nll_x = lse_and_nll(folds[r].m, folds[r].l, folds[r].diag_rows)
        coef = torch.expm1(-nll_x) + torch.expm1(-b_nll[r][1])
        for step in range(world):
            j = (r - step) % world
            pairing = Pairing(a, b_nll[j][0], coef, 0 if j == r else None)
            g_y[j] += ops[r].ring_products(x[r], y[j], scale, pairing, g_x[r])
    out = scale / (2 * world * c)
    return torch.cat(g_x) * out, torch.cat(g_y) * out


def merge_pairs(first, second):
    """Two column (m, l) partials of the online fold merged (`pieces.online_softmax.merge`)."""
    return merge(*first, *second)


@pytest.mark.parametrize("dtype, worlds", [(torch.float64, (1, 3, 8)), (torch.float32, (2,))], ids=["f64", "f32"])
def test_rings_in_one_process_equal_autograd_and_the_torch_tiles(dtype, worlds, monkeypatch):
    """P ranks of C = 5 pairs (N = 5 P), each visit's S one chunk, kept from pass 1 for pass 2 while the budget
    holds it: the gradients equal plain autograd and the torch tiles; with room for every visit the S of pass 2
    is pass 1's (P^2 GEMMs of S, not 2 P^2), and at P = 3 with no room at all (every S made again) the
    gradients are the same to the bit."""
    made = []
    real_chunk = s_in_memory.s_chunk
    monkeypatch.setattr(s_in_memory, "s_chunk", lambda *a: made.append(1) or real_chunk(*a))
    for world in worlds:
        z_x, z_y = embeddings(dtype, 5 * world, 5 * world, seed=world)
        x, y = list(z_x.split(5)), list(z_y.split(5))
        truth_x, truth_y = infonce_truth(z_x, z_y, SCALE)
        made.clear()
        roomy = infonce_ring_in_one_process(x, y, SCALE, lambda r: TritonTiles("float32", s_in_memory=True))
        assert len(made) == world * world, (world, len(made))  # pass 2 took every S back
        torch_tiles = infonce_ring_in_one_process(x, y, SCALE, lambda r: TorchTiles(4))
        for got in (roomy, torch_tiles):
            assert relative(got[0], truth_x) <= TOL[dtype] and relative(got[1], truth_y) <= TOL[dtype], world
        assert relative(roomy[0], torch_tiles[0]) <= TOL[dtype]
        if world == 3:
            made.clear()
            tight = lambda r: TritonTiles("float32", w_budget=1, s_in_memory=True)  # noqa: E731
            again = infonce_ring_in_one_process(x, y, SCALE, tight)
            assert len(made) == 2 * world * world  # no room: pass 2 made every S again
            assert torch.equal(roomy[0], again[0]) and torch.equal(roomy[1], again[1])


def test_the_sigmoid_ring_in_one_process_equals_autograd():
    """Each visit of the sigmoid ring (`sigmoid_block` with both products, as `ring.sigmoid_ring` calls it): S
    once, D over it in place, D y_j into the rows and D^T x_r carried to block j; float64 to 1e-10, with the
    loss and dL/dbeta, at P = 3."""
    for world in (3,):
        z_x, z_y = embeddings(torch.float64, 5 * world, 5 * world, seed=world)
        x, y, n = z_x.split(5), z_y.split(5), 5 * world
        loss, gx, gy, gb = sigmoid_truth(z_x, z_y, 10.0, -10.0)
        ops = TritonTiles("float32", s_in_memory=True)
        d_y, d_x = torch.zeros_like(z_x), torch.zeros_like(z_y)
        total, d_sum = 0.0, 0.0
        for r in range(world):
            for j in range(world):
                blk = ops.sigmoid_block(x[r], y[j], Logits(10.0, -10.0), (5 * r, 5 * j), n, (True, True))
                d_y[5 * r : 5 * r + 5] += blk.d_y
                d_x[5 * j : 5 * j + 5] += blk.d_x
                total, d_sum = total + blk.loss_sum.item(), d_sum + blk.d_sum.item()
        assert relative(d_y * 10.0, gx) <= 1e-10 and relative(d_x * 10.0, gy) <= 1e-10
        assert abs(total / n - loss) <= 1e-10 * loss and abs(d_sum - gb) <= 1e-10 * abs(gb)
