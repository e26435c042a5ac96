"""The contrastive building blocks on their own: the losses (stable at small tau, the local rows add
up to the global loss, bad input refused) and the gathers (what each one's backward returns)."""

import pytest
import torch
import torch.nn.functional as F

from distlab.contrastive.ddp_steps import contrastive_loss
from distlab.contrastive.gather import check_same_shape, gather_library, gather_plain, gather_with_grad
from distlab.contrastive.losses import clip_loss, local_clip_loss
from distlab.runtime import spawn


def _unit(n, d, seed, dtype=torch.float64):
    return F.normalize(torch.randn(n, d, generator=torch.Generator().manual_seed(seed), dtype=dtype), dim=-1)


def _hard_pairs(n=64, d=16, dtype=torch.float32):
    """Eight tight clusters of pairs: at tau = 0.01 the logits reach ~100 and the in-cluster
    negatives are almost as close as the positives, so loss and gradients are O(1), not ~0."""
    gen = torch.Generator().manual_seed(0)
    centres = torch.randn(8, d, generator=gen, dtype=torch.float64).repeat_interleave(n // 8, 0)
    z_x = F.normalize(centres + 0.1 * torch.randn(n, d, generator=gen, dtype=torch.float64), dim=-1)
    z_y = F.normalize(z_x + 0.05 * torch.randn(n, d, generator=gen, dtype=torch.float64), dim=-1)
    return z_x.to(dtype), z_y.to(dtype)


def _loss_and_grads(z_x, z_y, tau, loss_fn=clip_loss):
    z_x, z_y = z_x.clone().requires_grad_(), z_y.clone().requires_grad_()
    loss = loss_fn(z_x, z_y, tau)
    loss.backward()
    return loss.detach(), z_x.grad, z_y.grad


def _naive_clip_loss(z_x, z_y, tau):
    """softmax written as exp / sum(exp) without subtracting the maximum: what NOT to do."""
    e = torch.exp(z_x @ z_y.T / tau)
    return -(torch.log(e.diag() / e.sum(1)).mean() + torch.log(e.diag() / e.sum(0)).mean()) / 2


def test_small_tau_is_stable_in_float32():
    """tau = 0.01: float32 loss and gradients match float64 (rtol 1e-5 on the loss; gradients
    within 1e-4 of their largest entry, since the logits carry float32's ~1e-7 * 100 absolute error)."""
    z_x, z_y = _hard_pairs()
    assert (z_x @ z_y.T / 0.01).max() > 95  # the regime the test is about ...
    loss32, gx32, gy32 = _loss_and_grads(z_x, z_y, 0.01)
    loss64, gx64, gy64 = _loss_and_grads(z_x.double(), z_y.double(), 0.01)
    assert loss64 > 1 and gx64.abs().max() > 0.1  # ... and not a solved problem with ~0 gradients
    assert torch.isfinite(loss32) and torch.isfinite(gx32).all() and torch.isfinite(gy32).all()
    assert loss32.double().item() == pytest.approx(loss64.item(), rel=1e-5)
    for g32, g64 in ((gx32, gx64), (gy32, gy64)):
        assert (g32.double() - g64).abs().max() <= 1e-4 * g64.abs().max()


def test_the_stability_check_would_catch_a_naive_softmax():
    """exp(100) overflows float32 (max ~3.4e38): the unguarded formula gives inf/nan, so the test
    above can fail."""
    z_x, z_y = _hard_pairs()
    loss = _naive_clip_loss(z_x, z_y, 0.01)
    assert not torch.isfinite(loss)
    # ... while in float64 it is the same function as clip_loss (so it is a fair counterexample).
    assert _naive_clip_loss(z_x.double(), z_y.double(), 0.01).item() == pytest.approx(
        clip_loss(z_x.double(), z_y.double(), 0.01).item(), rel=1e-10)


@pytest.mark.parametrize("blocks", [1, 2, 3, 4])
def test_local_rows_average_to_the_global_loss(blocks):
    """mean over r of local_clip_loss(rows of block r, offset r*C) == clip_loss, value and gradient
    (every block sees the full, undetached Z: the decomposition the exact DDP step relies on)."""
    n, tau = 12, 0.07
    z_x, z_y = _unit(n, 5, 2), _unit(n, 5, 3)
    c = n // blocks

    def mean_of_local(zx, zy, tau):
        return sum(local_clip_loss(zx[r * c:(r + 1) * c], zy[r * c:(r + 1) * c], zx, zy, tau, r * c)
                   for r in range(blocks)) / blocks

    expected = _loss_and_grads(z_x, z_y, tau)
    got = _loss_and_grads(z_x, z_y, tau, mean_of_local)
    for e, g in zip(expected, got):
        assert torch.allclose(g, e, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("tau", [0.0, -0.1, float("nan")])
def test_non_positive_temperature_is_refused(tau):
    z = _unit(4, 3, 0)
    with pytest.raises(ValueError, match="tau must be > 0"):
        clip_loss(z, z, tau)
    with pytest.raises(ValueError, match="tau must be > 0"):
        local_clip_loss(z[:2], z[:2], z, z, tau, 0)


def test_mismatched_embeddings_are_refused():
    with pytest.raises(ValueError, match="N x d"):
        clip_loss(_unit(4, 3, 0), _unit(4, 5, 1), 0.1)


# -- gathers, through processes --------------------------------------------------------------

GATHERS = {"plain": gather_plain, "all_reduce": lambda t: gather_with_grad(t, "all_reduce"),
           "reduce_scatter": lambda t: gather_with_grad(t, "reduce_scatter"), "library": gather_library}
ROWS, COLS = 2, 3


def _block(rank):
    return torch.arange(ROWS * COLS, dtype=torch.float64).reshape(ROWS, COLS) + 100 * rank


def _weights(rank, world_size):
    """Rank r's loss is sum(W_r * gathered): its gradient w.r.t. the gathered tensor is W_r."""
    gen = torch.Generator().manual_seed(rank)
    return torch.randn(world_size * ROWS, COLS, generator=gen, dtype=torch.float64)


def _gather_forward_and_backward(rt):
    out = {}
    for name, gather in GATHERS.items():
        local = _block(rt.rank).requires_grad_()
        gathered = gather(local)
        (gathered * _weights(rt.rank, rt.world_size)).sum().backward()
        out[name] = (gathered.detach().clone(), local.grad.clone())
    return out


@pytest.fixture(scope="module")
def gathered_on_three_ranks():
    return spawn(_gather_forward_and_backward, 3)


@pytest.mark.parametrize("name", GATHERS)
def test_gather_forward_concatenates_and_backward_is_as_documented(name, gathered_on_three_ranks):
    world_size = 3
    everything = torch.cat([_block(r) for r in range(world_size)])
    summed = sum(_weights(s, world_size) for s in range(world_size))
    for rank, per_gather in enumerate(gathered_on_three_ranks):
        gathered, grad = per_gather[name]
        rows = slice(rank * ROWS, (rank + 1) * ROWS)
        assert torch.equal(gathered, everything)
        # plain: only this rank's own loss reaches its block; the fixes: every rank's loss does.
        expected = (_weights(rank, world_size) if name == "plain" else summed)[rows]
        assert torch.allclose(grad, expected, rtol=1e-12, atol=1e-12)
        assert not torch.allclose(grad, (summed if name == "plain" else _weights(rank, world_size))[rows])


def test_unknown_backward_is_refused():
    with pytest.raises(ValueError, match="all_reduce' or 'reduce_scatter"):
        gather_with_grad(torch.zeros(2, 2), backward="sum")


# -- bad input: the same ValueError on every rank, never a hang --------------------------------

def _catch(fn, *args):
    try:
        fn(*args)
        return "no error"
    except ValueError as err:
        return f"ValueError: {err}"


BAD_CASES = {  # case -> words the message must contain
    "embedding size": "one embedding size", "local batch": "equal local batches",
    "tau <= 0": "tau must be > 0", "tau differs": "same on every rank", "z_x vs z_y": "z_x and z_y of one shape",
}


def _loss_with(rt, case):
    c, d, tau = 4, 8, 0.1
    if case == "embedding size":
        d += rt.rank            # rank r's encoder makes d + r numbers
    elif case == "local batch":
        c += rt.rank % 2        # unequal shares of the global batch
    elif case == "tau <= 0":
        tau = 0.0
    elif case == "tau differs":
        tau = 0.1 if rt.rank else 0.2
    elif case == "z_x vs z_y" and rt.rank == 1:
        return _catch(contrastive_loss, _unit(c, d, 0), _unit(c, d + 1, 1), tau, "local_library")
    return _catch(contrastive_loss, _unit(c, d, rt.rank), _unit(c, d, 9 + rt.rank), tau, "local_library")


def _every_case(rt):
    """All cases in one process group: each error is raised on every rank before any collective but
    the (always matching) check itself, so the group stays usable for the next case."""
    out = {case: _loss_with(rt, case) for case in BAD_CASES}
    out["good input"] = _loss_with(rt, "fine")
    out["check_same_shape"] = _catch(check_same_shape, torch.zeros(2 + rt.rank, 3))
    return out


@pytest.fixture(scope="module")
def messages_on_three_ranks():
    return spawn(_every_case, 3, timeout_s=30)


def _messages(results, case):
    return [per_rank[case] for per_rank in results]


def test_check_same_shape_fails_on_every_rank(messages_on_three_ranks):
    messages = _messages(messages_on_three_ranks, "check_same_shape")
    assert len(set(messages)) == 1 and "same shape" in messages[0] and "(2, 3), (3, 3), (4, 3)" in messages[0]


@pytest.mark.parametrize("case", BAD_CASES)
def test_bad_input_fails_on_every_rank(case, messages_on_three_ranks):
    messages = _messages(messages_on_three_ranks, case)
    assert len(set(messages)) == 1, messages
    assert messages[0].startswith("ValueError") and BAD_CASES[case] in messages[0], messages[0]


def test_good_input_passes_the_check(messages_on_three_ranks):
    """Guard: the check above is not simply failing everything."""
    assert _messages(messages_on_three_ranks, "good input") == ["no error"] * 3
