"""The practitioner's swap, end to end: open_clip_train 3.3.0's own `main` at P = 2 on the CPU, once with open_clip's
`ClipLoss` (`--local-loss --gather-with-grad`: the exact global gradient) and once with distributed_clip's
`ClipLoss` in `create_loss`'s place (examples/open_clip_train_swap.py), on the same seeded random pairs. Every tensor
of the two final checkpoints (weights and SGD momentum after 3 steps) must agree to float32 rounding: rtol 1e-4,
atol 1e-5 (the two sum the same terms in different orders; measured max |difference| is printed). Teeth: the weights
moved (a loss that did nothing would match too), and each run's training loss was logged.

Skipped, with the reason printed, where open_clip_train is not installed (it is not in requirements.txt: PyPI's
torchvision for torch 2.13.0 is a CUDA build, which does not load on the CPU-only torch)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
import torch
from helpers import ROOT

if importlib.util.find_spec("open_clip_train") is None:
    reason = "open_clip_train is not installed (pip install open_clip_torch==3.3.0 and its training extras)"
    print(f"SKIPPED {__name__}: {reason}")
    pytest.skip(reason, allow_module_level=True)

RTOL, ATOL = 1e-4, 1e-5


def train(loss: str, out) -> dict:
    """open_clip_train's main with `loss`'s loss at P = 2; its final checkpoint."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    command += [str(ROOT / "examples" / "open_clip_train_swap.py"), f"--loss={loss}", f"--out={out}"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-4000:]
    assert "Contrastive_loss" in (out / loss / "out.log").read_text()  # open_clip_train's own log of the steps
    return torch.load(out / loss / "checkpoints" / "epoch_1.pt", map_location="cpu", weights_only=False)


def test_open_clip_train_main_with_distlab_s_loss_ends_at_open_clip_s_weights(tmp_path):
    ours, theirs = train("distlab", tmp_path), train("open_clip", tmp_path)
    assert ours["state_dict"].keys() == theirs["state_dict"].keys()
    worst, moved = 0.0, 0.0
    for name, tensor in theirs["state_dict"].items():
        assert torch.allclose(ours["state_dict"][name], tensor, rtol=RTOL, atol=ATOL), name
        worst = max(worst, (ours["state_dict"][name] - tensor).abs().max().item())
    for mine, other in zip(ours["optimizer"]["state"].values(), theirs["optimizer"]["state"].values()):
        assert torch.allclose(mine["momentum_buffer"], other["momentum_buffer"], rtol=RTOL, atol=ATOL)
        moved = max(moved, other["momentum_buffer"].abs().max().item())
    print(f"open_clip_train swap, P = 2, 3 steps: max |weight difference| {worst:.2e}")
    assert moved > 1e-2  # the gradient was not about 0: the run trained
