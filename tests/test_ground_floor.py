"""The ground floor every parallelism stands on, checked against what is known without it: the one training
loop against gradients and SGD steps derived by hand, the one run record's comparison, the one transformer
block against torch's attention, and the one saved-activation counter's rule (by storage) against bytes
counted by hand. Each check is shown to reject a wrong answer."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distlab.pieces.online_softmax import merge, online_fold
from distlab.proof.compare import against, compare_whole
from distlab.proof.held import SavedActivations, model_states, storage_bytes
from distlab.proof.models import Block, BlockOptions, token_batch
from distlab.proof.reference import one_process, sgd
from distlab.proof.training import Plain, reduce_gradients, train

LR, STEPS = 0.1, 3


def _linear_problem():
    gen = torch.Generator().manual_seed(0)
    x, t = torch.randn(8, 3, generator=gen, dtype=torch.float64), torch.randn(8, 2, generator=gen, dtype=torch.float64)
    model = nn.Linear(3, 2, bias=False, dtype=torch.float64)
    with torch.no_grad():
        model.weight.copy_(torch.randn(2, 3, generator=gen, dtype=torch.float64))
    return model, x, t


def _by_hand(w: torch.Tensor, x: torch.Tensor, t: torch.Tensor, steps: int):
    """L = mean((x W^T - t)^2) over its N x 2 entries: dL/dW = 2 (x W^T - t)^T x / (2N); SGD by hand."""
    grads, losses = [], []
    for _ in range(steps):
        residual = x @ w.T - t
        losses.append((residual**2).mean().item())
        grads.append(2 * residual.T @ x / residual.numel())
        w = w - LR * grads[-1]
    return grads[0], w, losses


def test_the_one_loop_equals_sgd_by_hand_and_a_wrong_sync_is_caught():
    model, x, t = _linear_problem()
    first, last, losses = _by_hand(model.weight.detach().clone(), x, t, STEPS)
    run = one_process(model, lambda k: (x, t), F.mse_loss, sgd(LR), STEPS)
    assert torch.allclose(run.first_grads["weight"], first, rtol=1e-12, atol=0)
    assert torch.allclose(run.params["weight"], last, rtol=1e-12, atol=0)
    assert run.losses == pytest.approx(losses, rel=1e-12)
    assert torch.equal(model.weight, _linear_problem()[0].weight)  # the reference trained a deep copy

    def step(k):
        loss = F.mse_loss(model(x), t)
        loss.backward()
        return loss

    def doubled():  # a sync that sums two "ranks" of the same gradient instead of averaging them
        model.weight.grad.mul_(2)

    wrong = train(Plain(model, torch.optim.SGD(model.parameters(), lr=LR), doubled), step, STEPS)
    parts = against(run, wrong)
    assert not parts["gradients"].ok and parts["gradients"].norm_ratio == pytest.approx(2.0)
    assert not parts["parameters"].ok


def test_the_record_keeps_optimizer_states_and_one_comparison_per_part():
    model, x, t = _linear_problem()
    adamw = one_process(model, lambda k: (x, t), F.mse_loss, torch.optim.AdamW, 2, keep_states=True)
    assert set(adamw.states["weight"]) == {"step", "exp_avg", "exp_avg_sq"}
    assert adamw.states["weight"]["step"].item() == 2
    again = one_process(model, lambda k: (x, t), F.mse_loss, torch.optim.AdamW, 2, keep_states=True)
    parts = against(adamw, again)
    assert list(parts) == ["gradients", "parameters", "optimizer states", "losses"]
    assert all(c.ok and c.max_abs == 0 for c in parts.values())
    again.states["weight"]["exp_avg"] *= 1 + 1e-6
    assert not against(adamw, again)["optimizer states"].ok


def test_compare_whole_is_the_group_as_one_vector():
    ref = {"a": torch.tensor([3.0, 0.0], dtype=torch.float64), "b": torch.tensor([0.0, 4.0], dtype=torch.float64)}
    quarter = {n: r / 4 for n, r in ref.items()}
    whole = compare_whole(ref, quarter)
    assert (whole.norm_ratio, whole.cosine, whole.ok) == (pytest.approx(0.25), pytest.approx(1.0), False)
    assert whole.shape == (4,) and whole.max_abs == pytest.approx(3.0)
    assert compare_whole(ref, quarter, scale=0.25).ok  # a 1/P claim, checked exactly


def test_reduce_gradients_is_one_message_copied_back():
    params = [nn.Parameter(torch.zeros(2, 3)), nn.Parameter(torch.zeros(4))]
    for k, p in enumerate(params):
        p.grad = torch.arange(p.numel(), dtype=torch.float32).view_as(p) + 10 * k
    messages = []

    def double(flat):
        messages.append(flat.shape)
        return 2 * flat

    reduce_gradients(params, double)
    assert messages == [torch.Size([10])]
    assert torch.equal(params[1].grad, 2 * (torch.arange(4.0) + 10))


@pytest.mark.parametrize("causal", [False, True])
def test_the_block_written_out_equals_torch_attention(causal):
    x, _ = token_batch(3, 8, 16, seed=1)
    out = {}
    for fused_qkv in (False, True):
        for sdpa in (False, True):
            block = Block(16, 4, 32, BlockOptions(causal, fused_qkv, sdpa), seed=2)
            out[fused_qkv, sdpa] = block(x)
    assert torch.allclose(out[False, False], out[False, True], rtol=1e-10, atol=1e-12)
    assert torch.allclose(out[True, False], out[True, True], rtol=1e-10, atol=1e-12)
    # and the mask matters: the causal block differs from the bidirectional one
    other = Block(16, 4, 32, BlockOptions(not causal), seed=2)(x)
    assert not torch.allclose(other, out[False, True])


def test_the_block_draws_from_its_own_generator():
    torch.manual_seed(1)
    one = Block(8, 2, 16, seed=5)
    torch.manual_seed(2)
    two = Block(8, 2, 16, seed=5)
    assert all(torch.equal(a, b) for a, b in zip(one.parameters(), two.parameters()))  # whatever the global stream
    assert not torch.equal(one.ln1.weight, torch.ones(8, dtype=torch.float64))  # the gains are drawn too
    draws = []
    for seed in (5, 6):  # a block that reseeded the global generator would leave it where its seed put it
        torch.manual_seed(3)
        Block(8, 2, 16, seed=seed)
        draws.append(torch.rand(3))
    assert torch.equal(*draws)
    names = [n for n, _ in Block(8, 2, 16, BlockOptions(fused_qkv=True)).named_parameters()]
    assert "attn.qkv.weight" in names and "attn.q.weight" not in names


def test_saved_activations_are_counted_by_storage():
    w = nn.Parameter(torch.randn(4, 12, dtype=torch.float64))
    x = torch.randn(5, 4, dtype=torch.float64)
    with SavedActivations(exclude=[w]) as saved:
        qkv = x @ w  # saves x (5 x 4) and w (excluded: a parameter)
        q, k, _ = qkv.split(4, dim=1)  # views of one 5 x 12 storage
        y = torch.tanh(q * k)  # saves q and k (two views of it), and tanh's output (5 x 4)
    assert saved.nbytes == 8 * (5 * 4 + 5 * 12 + 5 * 4)  # x; qkv's storage once and whole; tanh's output
    assert saved.nbytes != 8 * (5 * 4 + 2 * 5 * 4 + 5 * 4)  # what counting by view would say
    y.sum().backward()  # the saved tensors were handed back untouched


def test_model_states_and_storage_bytes():
    model = nn.Linear(3, 2, dtype=torch.float64)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3, dtype=torch.float64)).sum().backward()
    optimizer.step()
    params = list(model.parameters())
    items = model_states(params, [p.grad for p in params], [optimizer.state[p] for p in params])
    bytes_by_item = {k: storage_bytes(v) for k, v in items.items()}
    assert bytes_by_item == {"weights": 64, "gradients": 64, "moments": 128, "step counts": 8}
    flat = torch.zeros(10)
    assert storage_bytes([flat[:3], flat[5:], flat]) == 40  # views of one storage: once, whole


def test_two_partial_folds_merge_into_the_whole_rows_log_sum_exp():
    """`merge` of the folds of two column ranges equals torch.logsumexp of the whole row (float64); the same
    merge without the rescale to the larger max (a wrong twin) does not."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 12, generator=gen, dtype=torch.float64) * 30  # large logits: exp alone would overflow
    folds = []
    for part in (x[:, :7], x[:, 7:]):
        m, l_ = torch.full((5,), float("-inf"), dtype=x.dtype), torch.zeros(5, dtype=x.dtype)
        folds.append(online_fold(m, l_, part.clone(), dim=1))
    m, l_ = merge(*folds[0], *folds[1])
    torch.testing.assert_close(m + l_.log(), torch.logsumexp(x, dim=1), rtol=1e-12, atol=1e-12)
    wrong = torch.maximum(folds[0][0], folds[1][0]) + (folds[0][1] + folds[1][1]).log()  # sums never rescaled
    assert not torch.allclose(wrong, torch.logsumexp(x, dim=1), rtol=1e-6)
