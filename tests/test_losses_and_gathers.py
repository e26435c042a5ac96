"""The contrastive building blocks on their own: the losses (stable at small tau, the local rows add
up to the global loss, bad input refused), the gathers (what each one's backward returns), and the
reference that replays each rank's dropout in one process."""

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_gather_result, gather_forward_and_backward, value_error

from distlab.contrastive.gather import gather_library, gather_plain, gather_with_grad
from distlab.contrastive.losses import clip_loss, local_clip_loss
from distlab.contrastive.reference import RankStreams, as_ranks, full_batch_gradients
from distlab.contrastive.step import contrastive_loss
from distlab.contrastive.variants import LOCAL_LIBRARY
from distlab.pieces.chunks import chunks
from distlab.processes.spawn import spawn
from distlab.proof.models import TwoTower, paired_data


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


def _loss_and_grads(z_x, z_y, s, loss_fn=clip_loss):
    z_x, z_y = z_x.clone().requires_grad_(), z_y.clone().requires_grad_()
    loss = loss_fn(z_x, z_y, s)
    loss.backward()
    return loss.detach(), z_x.grad, z_y.grad


def _naive_clip_loss(z_x, z_y, s):
    """softmax written as exp / sum(exp) without subtracting the maximum: what NOT to do."""
    e = torch.exp(s * z_x @ z_y.T)
    return -(torch.log(e.diag() / e.sum(1)).mean() + torch.log(e.diag() / e.sum(0)).mean()) / 2


def test_small_tau_is_stable_in_float32():
    """tau = 0.01: float32 loss and gradients match float64 (rtol 1e-5 on the loss; gradients
    within 1e-4 of their largest entry, since the logits carry float32's ~1e-7 * 100 absolute error)."""
    z_x, z_y = _hard_pairs()
    assert (z_x @ z_y.T / 0.01).max() > 95  # the regime the test is about ...
    loss32, gx32, gy32 = _loss_and_grads(z_x, z_y, 100.0)
    loss64, gx64, gy64 = _loss_and_grads(z_x.double(), z_y.double(), 100.0)
    assert loss64 > 1 and gx64.abs().max() > 0.1  # ... and not a solved problem with ~0 gradients
    assert torch.isfinite(loss32) and torch.isfinite(gx32).all() and torch.isfinite(gy32).all()
    assert loss32.double().item() == pytest.approx(loss64.item(), rel=1e-5)
    for g32, g64 in ((gx32, gx64), (gy32, gy64)):
        assert (g32.double() - g64).abs().max() <= 1e-4 * g64.abs().max()


def test_the_stability_check_would_catch_a_naive_softmax():
    """exp(100) overflows float32 (max ~3.4e38): the unguarded formula gives inf/nan, so the test
    above can fail."""
    z_x, z_y = _hard_pairs()
    loss = _naive_clip_loss(z_x, z_y, 100.0)
    assert not torch.isfinite(loss)
    # ... while in float64 it is the same function as clip_loss (so it is a fair counterexample).
    assert _naive_clip_loss(z_x.double(), z_y.double(), 100.0).item() == pytest.approx(
        clip_loss(z_x.double(), z_y.double(), 100.0).item(), rel=1e-10
    )


@pytest.mark.parametrize("blocks", [1, 2, 3, 4])
def test_local_rows_average_to_the_global_loss(blocks):
    """mean over r of local_clip_loss(rows of block r, offset r*C) == clip_loss, value and gradient
    (every block sees the full, undetached Z: the decomposition the exact DDP step relies on)."""
    n, tau = 12, 0.07
    z_x, z_y = _unit(n, 5, 2), _unit(n, 5, 3)
    c = n // blocks

    def mean_of_local(zx, zy, s):
        return (
            sum(
                local_clip_loss(zx[r * c : (r + 1) * c], zy[r * c : (r + 1) * c], zx, zy, s, r * c)
                for r in range(blocks)
            )
            / blocks
        )

    expected = _loss_and_grads(z_x, z_y, 1 / tau)
    got = _loss_and_grads(z_x, z_y, 1 / tau, mean_of_local)
    for e, g in zip(expected, got):
        assert torch.allclose(g, e, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("s", [0.0, -10.0, float("nan")])
def test_non_positive_scale_is_refused(s):
    z = _unit(4, 3, 0)
    with pytest.raises(ValueError, match="s = 1/tau must be > 0"):
        clip_loss(z, z, s)
    with pytest.raises(ValueError, match="s = 1/tau must be > 0"):
        local_clip_loss(z[:2], z[:2], z, z, s, 0)


def test_mismatched_embeddings_are_refused():
    with pytest.raises(ValueError, match="N x d"):
        clip_loss(_unit(4, 3, 0), _unit(4, 5, 1), 10.0)


# -- gathers, through processes --------------------------------------------------------------

GATHERS = {"plain": gather_plain, "reduce_scatter": gather_with_grad, "library": gather_library}
# Lesson 23's own all_reduce form is checked the same way in tests/test_lesson23_*.


def _gather_forward_and_backward(rt):
    return {name: gather_forward_and_backward(rt, gather) for name, gather in GATHERS.items()}


@pytest.fixture(scope="module")
def gathered_on_three_ranks():
    return spawn(_gather_forward_and_backward, 3)


@pytest.mark.parametrize("name", GATHERS)
def test_gather_forward_concatenates_and_backward_is_as_documented(name, gathered_on_three_ranks):
    for rank, per_gather in enumerate(gathered_on_three_ranks):
        gathered, grad = per_gather[name]
        # plain: only this rank's own loss reaches its block; the fixes: every rank's loss does.
        assert_gather_result(rank, 3, gathered, grad, sums_over_ranks=name != "plain")


# -- bad input: the same ValueError on every rank, never a hang --------------------------------

BAD_CASES = {  # case -> words the message must contain
    "embedding size": "one embedding size",
    "local batch": "equal local batches",
    "tau <= 0": "tau must be > 0",
    "tau differs": "same on every rank",
    "z_x vs z_y": "z_x and z_y of one shape",
}


def _loss_with(rt, case):
    c, d, tau = 4, 8, 0.1
    if case == "embedding size":
        d += rt.rank  # rank r's encoder makes d + r numbers
    elif case == "local batch":
        c += rt.rank % 2  # unequal shares of the global batch
    elif case == "tau <= 0":
        tau = 0.0
    elif case == "tau differs":
        tau = 0.1 if rt.rank else 0.2
    elif case == "z_x vs z_y" and rt.rank == 1:
        return value_error(contrastive_loss, rt, _unit(c, d, 0), _unit(c, d + 1, 1), tau, LOCAL_LIBRARY)
    return value_error(contrastive_loss, rt, _unit(c, d, rt.rank), _unit(c, d, 9 + rt.rank), tau, LOCAL_LIBRARY)


def _every_case(rt):
    """All cases in one process group: each error is raised on every rank before any collective but
    the (always matching) check itself, so the group stays usable for the next case."""
    out = {case: _loss_with(rt, case) for case in BAD_CASES}
    out["good input"] = _loss_with(rt, "fine")
    return out


@pytest.fixture(scope="module")
def messages_on_three_ranks():
    return spawn(_every_case, 3, timeout_s=30)


def _messages(results, case):
    return [per_rank[case] for per_rank in results]


@pytest.mark.parametrize("case", BAD_CASES)
def test_bad_input_fails_on_every_rank(case, messages_on_three_ranks):
    messages = _messages(messages_on_three_ranks, case)
    assert len(set(messages)) == 1, messages
    assert messages[0] is not None and BAD_CASES[case] in messages[0], messages[0]


def test_good_input_passes_the_check(messages_on_three_ranks):
    """Guard: the check above is not simply failing everything."""
    assert _messages(messages_on_three_ranks, "good input") == [None] * 3


# -- the reference with each rank's dropout replayed ----------------------------------------------

REPLAY_SEEDS, REPLAY_N, REPLAY_B = (100, 101), 12, 4


def _rank_embeddings(rt, tower_by_tower):
    """What rank r really computes, two steps in a row: its share in micro-batches of B, from its
    own stream (torch.manual_seed(seeds[r]) once, then carried on)."""
    model = TwoTower(dropout=0.3, seed=1)
    torch.manual_seed(REPLAY_SEEDS[rt.rank])
    c = REPLAY_N // rt.world_size
    steps = []
    for step in range(2):
        x, y = (t[rt.rank * c : (rt.rank + 1) * c] for t in paired_data(REPLAY_N, seed=step))
        if tower_by_tower:
            zx = [F.normalize(model.encoder_x(x[i : i + REPLAY_B]), dim=-1) for i in range(0, c, REPLAY_B)]
            zy = [F.normalize(model.encoder_y(y[i : i + REPLAY_B]), dim=-1) for i in range(0, c, REPLAY_B)]
        else:
            zx, zy = zip(*[model(x[i : i + REPLAY_B], y[i : i + REPLAY_B]) for i in range(0, c, REPLAY_B)])
        steps.append((torch.cat(zx).detach(), torch.cat(zy).detach()))
    return steps


@pytest.mark.parametrize("tower_by_tower", [False, True], ids=["model per micro-batch", "tower by tower"])
def test_as_ranks_replays_each_ranks_dropout(tower_by_tower):
    per_rank = spawn(_rank_embeddings, 2, tower_by_tower)
    model = TwoTower(dropout=0.3, seed=1)
    streams = RankStreams(REPLAY_SEEDS)
    micro = chunks(REPLAY_N // 2, REPLAY_B)
    forward = as_ranks(streams, micro, tower_by_tower=tower_by_tower)
    other = as_ranks(RankStreams((7, 8)), micro, tower_by_tower=tower_by_tower)
    outside = torch.get_rng_state()
    for step in range(2):  # the second step goes on from where each rank's stream stopped
        x, y = paired_data(REPLAY_N, seed=step)
        z_x, z_y = forward(model, x, y)
        assert torch.equal(z_x, torch.cat([r[step][0] for r in per_rank]))
        assert torch.equal(z_y, torch.cat([r[step][1] for r in per_rank]))
        assert not torch.equal(other(model, x, y)[0], z_x)  # other streams, other masks: the check has teeth
    assert torch.equal(torch.get_rng_state(), outside)  # the caller's stream is untouched


def test_replayed_reference_is_the_gradient_of_the_replayed_forward():
    """full_batch_gradients with a replayed forward: dropout on, the loss of those exact embeddings."""
    model, (x, y) = TwoTower(dropout=0.3, seed=1), paired_data(REPLAY_N, seed=0)
    micro = chunks(REPLAY_N // 2, REPLAY_B)
    loss, grads = full_batch_gradients(model, x, y, 10.0, forward=as_ranks(RankStreams(REPLAY_SEEDS), micro))
    z_x, z_y = as_ranks(RankStreams(REPLAY_SEEDS), micro)(model, x, y)
    assert loss == pytest.approx(clip_loss(z_x, z_y, 10.0).item(), rel=1e-12)
    assert all(p.grad is None for p in model.parameters())  # a deep copy was trained, not `model`
    assert loss != pytest.approx(full_batch_gradients(model, x, y, 10.0)[0], rel=1e-6)  # dropout did act
