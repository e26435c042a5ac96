"""The loss modules in a practitioner's loop: validation under torch.no_grad(), a loss called on some ranks
only, a second backward, and the fused finite-gradient guard.

- Under torch.no_grad() (every validation loop) `ClipLoss` runs no phase 3 (counted: 0 calls, against at
  least 1 with gradients on) and `SigLipLoss` makes S once with no G (one tile pass wanting nothing, against
  two wanting G); the loss is the same number as with gradients on, bit for bit, gathered at P = 2 and alone.
  The cost (the module under no_grad against the loss alone) is a benchmark row
  (`benchmarks/loss_module_costs.py`), not a timed test.
- A loss called an extra time on rank 0 (a validation call, or a second module) ends on both ranks with one
  ValueError naming each rank's call; a rank left alone in the call raises naming its call once its peer has
  gone, within the group's timeout, never a silent hang.
- A second backward through one call is a RuntimeError that says what happened (the first one still works).
- In open_clip_train's own `--accum-freq 3` loop (tests/open_clip_like.py's `accum_freq_backward`) the module
  gives open_clip's own gradients to 1e-10, the logit scale's k-fold one included (3.000 times the true dL/ds,
  which `distributed_backward` with B < C gives): it copies open_clip's recipe there, for better and worse.
- `finite_flags` equals per-tensor `torch.isfinite(g).all()` on gradients of four dtypes with a single inf or
  NaN anywhere; a finite 1e300 and a float16 gradient whose sum overflows are not flagged (a sum-based twin
  flags them), and every value is kept bit for bit (GradScaler's check writes them back); at P = 2 one
  inf in any one parameter on one rank stops every rank naming that parameter.
"""

from __future__ import annotations

import re

import pytest
import torch
from open_clip_like import CLIP, accum_freq_backward, grads_by_name, image_text_data
from streamed_helpers import local_rows
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import distlab.streamed.loss_modules as loss_modules
from distlab.processes.spawn import spawn
from distlab.streamed.kernel_choice import TorchTiles
from distlab.streamed.safeguards.finite import agree_gradients_finite, finite_flags
from distributed_clip import ClipLoss, SigLipLoss, distributed_backward

C, D, T = 6, 8, 4


def _features(rank: int, grad: bool = True):
    gen = torch.Generator().manual_seed(10 + rank)
    z = [torch.nn.functional.normalize(torch.randn(C, D, generator=gen, dtype=torch.float64), dim=1) for _ in "xy"]
    return [t.requires_grad_(grad) for t in z]


def _counted(monkeypatch_like):
    """Count phase 3 calls and the sigmoid tile passes (with what they were asked for)."""
    counts = {"phase3": 0, "sigmoid": []}
    phase3 = loss_modules.phase3_embedding_grads
    block = TorchTiles.sigmoid_block

    def counting_phase3(*args, **kwargs):
        counts["phase3"] += 1
        return phase3(*args, **kwargs)

    def counting_block(self, *args, **kwargs):
        counts["sigmoid"].append(tuple(kwargs.get("want", args[-1] if len(args) > 4 else None)))
        return block(self, *args, **kwargs)

    monkeypatch_like(loss_modules, "phase3_embedding_grads", counting_phase3)
    monkeypatch_like(TorchTiles, "sigmoid_block", counting_block)
    return counts


def _no_grad_against_grad(rt) -> dict:
    """(loss, counts) for each loss under no_grad and with gradients on, on this rank."""
    out = {}
    patches = []

    def patch(owner, name, value):
        patches.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    counts = _counted(patch)
    try:
        for kind, make, extra in (("clip", ClipLoss, ()), ("siglip", SigLipLoss, (torch.tensor(-10.0),))):
            module = make(rank=rt.rank, world_size=rt.world_size, stream_chunk_size=T)
            s = torch.tensor(10.0, dtype=torch.float64, requires_grad=True)
            for mode in ("no_grad", "grad"):
                counts["phase3"], counts["sigmoid"] = 0, []
                with torch.no_grad() if mode == "no_grad" else torch.enable_grad():
                    loss = module(*_features(rt.rank), s, *extra)
                out[kind, mode] = (loss.item(), loss.requires_grad, counts["phase3"], list(counts["sigmoid"]))
    finally:
        for owner, name, value in patches:
            setattr(owner, name, value)
    return out


def _assert_no_gradient_work(results: list[dict]) -> None:
    for out in results:
        loss, requires, phase3, _ = out["clip", "no_grad"]
        assert phase3 == 0 and not requires, out  # no phase 3, no graph
        assert out["clip", "grad"][2] >= 1  # teeth: with gradients on, phase 3 runs (the counter counts)
        assert loss == out["clip", "grad"][0]  # the same number, bit for bit
        loss, requires, _, passes = out["siglip", "no_grad"]
        assert passes == [(False, False)] and not requires, out  # S once, no G
        assert out["siglip", "grad"][3] == [(True, False), (False, True)], out  # teeth: G_x's and G_y's passes
        assert loss == out["siglip", "grad"][0]


def test_under_no_grad_no_gradient_work_runs_alone():
    from distlab.processes.identity import Runtime

    rt = Runtime(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="none")
    _assert_no_gradient_work([_no_grad_against_grad(rt)])


def test_under_no_grad_no_gradient_work_runs_gathered_at_p2():
    _assert_no_gradient_work(spawn(_no_grad_against_grad, 2))


def _second_backward(rt) -> dict:
    z_x, z_y = _features(rt.rank)
    s = torch.tensor(10.0, dtype=torch.float64, requires_grad=True)
    loss = ClipLoss(rank=rt.rank, world_size=rt.world_size, stream_chunk_size=T)(z_x, z_y, s)
    loss.backward(retain_graph=True)
    first = z_x.grad is not None and bool(torch.isfinite(z_x.grad).all())
    try:
        loss.backward()
        return {"first": first, "second": "no error"}
    except RuntimeError as err:
        return {"first": first, "second": str(err)}


def test_a_second_backward_through_one_call_says_so():
    for out in spawn(_second_backward, 2):
        assert out["first"], out
        assert "a second backward through one call of the streamed loss module" in out["second"], out


def _extra_call(rt, how: str) -> str:
    """Both ranks train (one call); rank 0 then calls once more (`how`); then both train again."""
    train = ClipLoss(rank=rt.rank, world_size=rt.world_size, stream_chunk_size=T)
    valid = ClipLoss(rank=rt.rank, world_size=rt.world_size, stream_chunk_size=T)
    s = torch.tensor(10.0, dtype=torch.float64)
    train(*_features(rt.rank), s).backward()
    try:
        if rt.rank == 0 and how == "no_grad":
            with torch.no_grad():
                train(*_features(rt.rank, grad=False), s)
        if rt.rank == 0 and how == "another module":
            valid(*_features(rt.rank), s)
        if rt.rank == 0 or how != "peer gone":
            train(*_features(rt.rank), s).backward()
    except (ValueError, RuntimeError) as err:
        return f"{type(err).__name__}: {err}"
    return "no error"


@pytest.mark.parametrize(
    "how, rank0, rank1",
    [
        ("no_grad", "module 1 call 2 under no_grad", "module 1 call 2"),
        ("another module", "module 2 call 1", "module 1 call 2"),
    ],
)
def test_a_loss_called_on_rank_0_only_ends_on_every_rank_naming_the_calls(how, rank0, rank1):
    errors = spawn(_extra_call, 2, how, timeout_s=20)
    assert errors[0] == errors[1] and errors[0].startswith("ValueError: the ranks are in different loss calls"), errors
    assert f"rank 0: {rank0}, rank 1: {rank1}" in errors[0], errors


def test_a_rank_left_alone_in_a_call_raises_naming_it_not_a_silent_hang():
    errors = spawn(_extra_call, 2, "peer gone", timeout_s=10, limit_s=60)
    assert errors[1] == "no error"  # rank 1 made its calls and left
    assert re.match(r"RuntimeError: loss module 1, call 2: the other ranks did not make this call", errors[0]), errors


def test_the_fused_finite_check_equals_isfinite_on_every_tensor():
    gen = torch.Generator().manual_seed(0)
    dtypes = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
    grads = [torch.randn(int(n), generator=gen).to(dtypes[i % 4]) for i, n in enumerate(torch.randint(1, 50, (12,)))]
    grads.append(torch.empty(0))
    assert finite_flags(grads) == [True] * len(grads)
    grads[1][0] = 1e300  # float64: finite, and its square would overflow
    for bad in (float("inf"), float("-inf"), float("nan")):
        for i in range(len(grads) - 1):
            g = [t.clone() for t in grads]
            g[i][int(torch.randint(len(g[i]), (1,), generator=gen))] = bad
            assert finite_flags(g) == [bool(torch.isfinite(t).all()) for t in g], (bad, i)
            assert finite_flags(g)[i] is False


def _sum_check(grads: list[torch.Tensor]) -> list[bool]:
    """A wrong twin of `finite_flags`: a tensor's sum is finite when its values are, but a finite tensor's sum
    can overflow."""
    return [bool(torch.isfinite(g.sum())) for g in grads]


def test_the_fused_check_takes_no_large_finite_gradient_for_a_non_finite_one_and_keeps_every_bit():
    big = torch.tensor([6e4, 6e4, -1.0], dtype=torch.float16)  # finite; its float16 sum overflows
    tiny = torch.tensor([1e-40, -0.0, 3.0, -2.5e-310], dtype=torch.float64).to(torch.float32)  # a subnormal, -0
    grads = [big, tiny, torch.tensor([1e300, -1e300], dtype=torch.float64)]
    before = [g.clone() for g in grads]
    assert finite_flags(grads) == [True, True, True]
    assert _sum_check(grads) != [True, True, True]  # the twin is rejected: the check is no sum
    for g, was in zip(grads, before):  # GradScaler's check with scale 1 writes each value back unchanged
        assert torch.equal(g.view(torch.uint8), was.view(torch.uint8))


def _one_inf_each(rt) -> list[str]:
    """For each parameter in turn: one inf in its last element, on rank 1 only; what each rank raised."""
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    said = []
    for bad in model.parameters():
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        if rt.rank == 1:
            bad.grad.view(-1)[bad.numel() - 1] = float("inf")
        try:
            agree_gradients_finite(model)
            said.append("no error")
        except FloatingPointError as err:
            said.append(str(err))
    return said


def test_one_inf_in_any_parameter_on_one_rank_stops_every_rank():
    names = [name for name, _ in nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).named_parameters()]
    rank0, rank1 = spawn(_one_inf_each, 2)
    assert rank0 == rank1 and len(rank0) == len(names)
    for name, error in zip(names, rank0):
        assert f"in {name}:" in error, (name, error)


def _accum_freq(rt) -> dict:
    """Gradients by name after open_clip's --accum-freq 3 step: its own loss, the module, and the exact step."""
    images, texts = image_text_data(24)
    rows = local_rows(rt, 24)
    batches = [(images[rows][k : k + 4], texts[rows][k : k + 4]) for k in range(0, 12, 4)]
    out = {}
    for name in ("open_clip", "module"):
        model = CLIP(output_dict=True)
        module = ClipLoss(rank=rt.rank, world_size=rt.world_size, stream_chunk_size=5)
        accum_freq_backward(DDP(model), batches, None if name == "open_clip" else module)
        out[name] = grads_by_name(model)
    model = CLIP(output_dict=True)
    config = {"GLOBAL_BATCH_SIZE": 24, "MICRO_BATCH_SIZE": 4, "STREAM_CHUNK_SIZE": 5}
    distributed_backward(DDP(model), images[rows], texts[rows], config)
    out["exact"] = grads_by_name(model)
    return out


def test_in_open_clips_accum_freq_loop_the_module_copies_open_clips_gradients():
    out = spawn(_accum_freq, 2)[0]
    for name, g in out["open_clip"].items():
        torch.testing.assert_close(out["module"][name], g, rtol=1e-10, atol=1e-14, msg=name)
    ratio = (out["module"]["logit_scale"] / out["exact"]["logit_scale"]).item()
    assert abs(ratio - 3) < 1e-9, ratio  # k = 3 backwards, each carrying the scale's whole gradient
    encoders = [k for k in out["exact"] if k != "logit_scale"]
    assert all(torch.allclose(out["module"][k], out["exact"][k], rtol=1e-10, atol=1e-14) for k in encoders)
