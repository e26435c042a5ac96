"""The sigmoid loss's tile math and the ring passes, against plain autograd on the whole batch.

One process, float64, 1e-10: the closed forms of dL/dS, dL/ds, dL/dbeta (distlab.streamed.sigmoid) and
the two InfoNCE ring passes and the sigmoid ring (distlab.streamed.ring_passes), first with P ranks as threads
in one process, then on real ranks (spawn, gloo, batch_isend_irecv). The bytes each rank sends equal
expected_ring_bytes. The reference is autograd of L written out plainly, with s and beta as ordinary tensors.
"""

import pytest
import torch
import torch.nn.functional as F

from distlab.processes.spawn import spawn
from distlab.streamed.exchange import sigmoid_gathered
from distlab.streamed.ring_passes import P2PRing, expected_ring_bytes, infonce_ring, run_in_threads, sigmoid_ring
from distlab.streamed.sigmoid import Logits

TOL = dict(rtol=1e-10, atol=1e-10)


def embeddings(n, d, spread, seed=0):
    gen = torch.Generator().manual_seed(seed)
    z_x = torch.randn(n, d, generator=gen, dtype=torch.float64)
    z_y = z_x + spread * torch.randn(n, d, generator=gen, dtype=torch.float64)
    return F.normalize(z_x, dim=1), F.normalize(z_y, dim=1)


def autograd_reference(z_x, z_y, s, b, loss):
    """(L, G_x, G_y, dL/ds, dL/dbeta) by autograd of the loss written on the whole N x N matrix."""
    z_x, z_y = z_x.clone().requires_grad_(), z_y.clone().requires_grad_()
    s_t = torch.tensor(s, dtype=torch.float64, requires_grad=True)
    b_t = torch.tensor(b, dtype=torch.float64, requires_grad=True)
    logits = s_t * z_x @ z_y.T
    if loss == "sigmoid":
        labels = 2 * torch.eye(len(z_x), dtype=torch.float64) - 1
        value = -F.logsigmoid(labels * (logits + b_t)).sum() / len(z_x)
    else:
        target = torch.arange(len(z_x))
        value = (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target)) / 2
    value.backward()
    return value.detach(), z_x.grad, z_y.grad, s_t.grad, b_t.grad


def assert_shares_add_up(shares, ref, loss):
    value, g_x, g_y, g_s, g_b = ref
    torch.testing.assert_close(sum(sh.loss_part for sh in shares), value, **TOL)
    torch.testing.assert_close(torch.cat([sh.g_x for sh in shares]), g_x, **TOL)
    torch.testing.assert_close(torch.cat([sh.g_y for sh in shares]), g_y, **TOL)
    torch.testing.assert_close(sum(sh.g_s for sh in shares), g_s, **TOL)
    if loss == "sigmoid":
        torch.testing.assert_close(sum(sh.g_b for sh in shares), g_b, **TOL)


@pytest.mark.parametrize("world,t", [(1, 4), (2, 3), (3, 5), (4, 16)])
def test_sigmoid_gathered_shares_equal_autograd(world, t):
    n = 12
    z_x, z_y = embeddings(n, 5, 0.5)
    s, b = 7.0, -3.0
    c = n // world
    shares = [sigmoid_gathered(z_x, z_y, Logits(s, b), slice(r * c, (r + 1) * c), t) for r in range(world)]
    assert_shares_add_up(shares, autograd_reference(z_x, z_y, s, b, "sigmoid"), "sigmoid")


def test_sigmoid_stable_for_logits_in_the_hundreds():
    """|S| up to ~500 (s = 400, beta = -100): every number finite and equal to autograd's, whose
    logsigmoid is the stable reference; a naive float32 log(sigmoid(.)) gives -inf here."""
    z_x, z_y = embeddings(8, 4, 1.0, seed=1)
    s, b = 400.0, -100.0
    naive = torch.log(torch.sigmoid(-(s * z_x @ z_y.T + b).float()))
    assert torch.isinf(naive).any()  # log(sigmoid(.)) in float32 underflows to -inf
    shares = [sigmoid_gathered(z_x, z_y, Logits(s, b), slice(r * 4, r * 4 + 4), 3) for r in range(2)]
    assert all(torch.isfinite(sh.g_x).all() and torch.isfinite(sh.loss_part) for sh in shares)
    assert_shares_add_up(shares, autograd_reference(z_x, z_y, s, b, "sigmoid"), "sigmoid")
    # float32 tiles: the loss within float32's rounding of autograd's float64.
    ref32 = sum(
        sigmoid_gathered(z_x.float(), z_y.float(), Logits(s, b), slice(r * 4, r * 4 + 4), 3).loss_part for r in range(2)
    )
    torch.testing.assert_close(ref32.double(), autograd_reference(z_x, z_y, s, b, "sigmoid")[0], rtol=1e-5, atol=1e-4)


def run_ring(ring, z_x, z_y, loss, t, s=9.0, b=-2.0):
    c = len(z_x) // ring.world
    mine = slice(ring.rank * c, ring.rank * c + c)
    if loss == "sigmoid":
        return sigmoid_ring(ring, z_x[mine], z_y[mine], Logits(s, b), t)
    return infonce_ring(ring, z_x[mine], z_y[mine], s, t)


@pytest.mark.parametrize("loss", ["infonce", "sigmoid"])
@pytest.mark.parametrize("world,t", [(1, 4), (2, 3), (3, 2), (4, 8)])
def test_the_ring_in_threads_equals_autograd_and_sends_its_formula(loss, world, t):
    n, d = 12, 5
    z_x, z_y = embeddings(n, d, 0.3)
    shares, ends = run_in_threads(world, lambda ring: run_ring(ring, z_x, z_y, loss, t))
    assert_shares_add_up(shares, autograd_reference(z_x, z_y, 9.0, -2.0, loss), loss)
    assert [e.ledger.sent for e in ends] == [expected_ring_bytes(world, n // world, d, 8, loss)] * world
    # features are posted before the tiles that read them: "post block" precedes "tiles" at each step
    for e in ends[:1] if world > 1 else []:
        steps = [what for k, what, _ in e.events if k == 0]
        assert steps[0].startswith("post block") and steps[1].startswith("begin tiles"), steps


def _ring_on_ranks(rt, n, d):
    z_x, z_y = embeddings(n, d, 0.3)
    out = {}
    for loss in ("infonce", "sigmoid"):
        ring = P2PRing(rt.world_size, rt.rank)
        out[loss] = run_ring(ring, z_x, z_y, loss, 3), ring.ledger.sent
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_real_ring_equals_autograd_and_sends_its_formula(world):
    n, d = 12, 4
    z_x, z_y = embeddings(n, d, 0.3)
    runs = spawn(_ring_on_ranks, world, n, d)
    for loss in ("infonce", "sigmoid"):
        shares = [run[loss][0] for run in runs]
        assert_shares_add_up(shares, autograd_reference(z_x, z_y, 9.0, -2.0, loss), loss)
        assert [run[loss][1] for run in runs] == [expected_ring_bytes(world, n // world, d, 8, loss)] * world
