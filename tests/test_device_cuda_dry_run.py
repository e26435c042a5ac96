"""`--device cuda` without a GPU: everything of the GPU path that can be checked on a CPU machine.

1. Every lesson given `--device cuda` on a machine without GPUs (or a device no machine has) stops
   with one error line that names `--device`, exit code 2, no traceback, and no process group (run
   in this process: torchrun's variables set by hand, so nothing connects anywhere).
2. `distributed()` on a node that reports GPUs (the count faked) takes the GPU backend
   `cpu:gloo,cuda:nccl`, gives each rank `cuda:LOCAL_RANK`, and binds the group to it; a rank that a
   launcher bound to one GPU through CUDA_VISIBLE_DEVICES (SLURM's way) takes that one, `cuda:0`; too few
   GPUs for the ranks on the node is the same one-line error. Strict mode there compares real devices.
3. What the library hands back lives on `rt.device`: run in strict mode on P = 2 ranks, where
   `rt.device` is `cpu:0`, the GPU's stand-in, and a tensor left on the host reports `cpu`.
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from distlab.processes.runtime import GPU_BACKEND, distributed
from distlab.processes.spawn import spawn
from distlab.processes.strict import STAND_IN, StrictDeviceError, strict_device

LESSONS = sorted((Path(__file__).resolve().parent.parent / "lessons").glob("[0-9][0-9]_*.py"))


def _torchrun_env(monkeypatch, rank: int, world_size: int) -> None:
    for name, value in (
        ("RANK", rank),
        ("WORLD_SIZE", world_size),
        ("LOCAL_RANK", rank),
        ("LOCAL_WORLD_SIZE", world_size),
    ):
        monkeypatch.setenv(name, str(value))
    for name in ("MASTER_ADDR", "MASTER_PORT", "DISTLAB_STRICT_DEVICE"):  # a group that slipped through
        monkeypatch.delenv(name, raising=False)  # fails at once, never waits
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)  # no launcher's binding unless a test sets one


NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: --device cuda would run")
BAD_DEVICES = {  # --device value -> the one error line
    "cuda": "--device cuda needs one GPU per rank: 2 ranks on this node, 0 GPUs",
    "tpu": "argument --device: invalid choice: 'tpu'",
}


SHAPE_AT_2 = {"composed_mesh": ["--dp", "2", "--pp", "1", "--tp", "1", "--cp", "1"]}  # its default mesh is 8 ranks


@pytest.mark.parametrize("value", [pytest.param("cuda", marks=NO_GPU), "tpu"])
@pytest.mark.parametrize("lesson", LESSONS, ids=[p.stem for p in LESSONS])
def test_a_device_this_machine_lacks_is_one_line_naming_the_flag(lesson, value, monkeypatch, capsys):
    _torchrun_env(monkeypatch, rank=0, world_size=2)
    monkeypatch.setattr(sys, "argv", [str(lesson), "--device", value, *SHAPE_AT_2.get(lesson.stem[3:], [])])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(lesson), run_name="__main__")
    out, err = capsys.readouterr()
    text = out + err
    errors = [line for line in text.splitlines() if "error" in line.lower()]
    assert exit_.value.code == 2 and "Traceback" not in text, text
    assert len(errors) == 1 and BAD_DEVICES[value] in errors[0], text
    assert not dist.is_initialized()


class _FakeGPUs:
    """A node that reports `count` GPUs; records what `distributed()` asks of torch."""

    def __init__(self, monkeypatch, count: int):
        self.set_device, self.init = [], {}
        monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "set_device", self.set_device.append)
        monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: self.init.update(backend=backend, **kw))
        monkeypatch.setattr(dist, "destroy_process_group", lambda *a, **kw: None)


@pytest.mark.parametrize("device", ["auto", "cuda"])
def test_distributed_on_a_gpu_node_takes_the_gpu_backend_and_the_local_gpu(monkeypatch, device):
    _torchrun_env(monkeypatch, rank=1, world_size=2)
    gpus = _FakeGPUs(monkeypatch, count=2)
    with distributed(device) as rt:
        assert (rt.backend, rt.device) == (GPU_BACKEND, torch.device("cuda", 1))
    assert gpus.set_device == [torch.device("cuda", 1)]
    assert gpus.init["backend"] == GPU_BACKEND and gpus.init["device_id"] == torch.device("cuda", 1)
    assert (gpus.init["rank"], gpus.init["world_size"]) == (1, 2) and gpus.init["timeout"].total_seconds() > 0


def test_too_few_gpus_for_the_ranks_on_the_node(monkeypatch):
    _torchrun_env(monkeypatch, rank=0, world_size=2)
    gpus = _FakeGPUs(monkeypatch, count=1)
    with distributed("auto") as rt:  # auto falls back to the CPU...
        assert (rt.backend, rt.device) == ("gloo", torch.device("cpu"))
    with pytest.raises(ValueError, match="--device cuda needs one GPU per rank: 2 ranks on this node, 1 GPUs"):
        with distributed("cuda"):  # ...an explicit cuda refuses, before any group exists
            pass
    assert gpus.init["backend"] == "gloo" and gpus.set_device == []


@pytest.mark.parametrize("device", ["auto", "cuda"])
def test_a_rank_bound_to_one_gpu_by_cuda_visible_devices_takes_it(monkeypatch, device):
    """SLURM's --gpus-per-task=1: rank 1 of 2 on the node sees one GPU, its own, as cuda:0."""
    _torchrun_env(monkeypatch, rank=1, world_size=2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    gpus = _FakeGPUs(monkeypatch, count=1)
    with distributed(device) as rt:
        assert (rt.backend, rt.device) == (GPU_BACKEND, torch.device("cuda", 0))
    assert gpus.set_device == [torch.device("cuda", 0)] and gpus.init["device_id"] == torch.device("cuda", 0)


def test_a_deterministic_group_on_a_gpu_node_runs_with_deterministic_kernels(monkeypatch):
    """`distributed(..., deterministic=True)`, what lessons 07 and 27 ask for: on while the block runs."""
    _torchrun_env(monkeypatch, rank=0, world_size=1)
    _FakeGPUs(monkeypatch, count=1)
    with distributed("cuda", deterministic=True):
        assert torch.are_deterministic_algorithms_enabled() and os.environ["CUBLAS_WORKSPACE_CONFIG"]
    assert not torch.are_deterministic_algorithms_enabled()
    with distributed("cuda"):
        assert not torch.are_deterministic_algorithms_enabled()


@pytest.mark.parametrize("visible", ["0,1", "", None])
def test_one_gpu_without_a_binding_is_not_one_per_rank(monkeypatch, visible):
    """One GPU seen and CUDA_VISIBLE_DEVICES unset, empty or naming two: a node's one GPU, not one per rank."""
    _torchrun_env(monkeypatch, rank=0, world_size=2)
    if visible is not None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    _FakeGPUs(monkeypatch, count=1)
    with distributed("auto") as rt:
        assert rt.device == torch.device("cpu")


def test_strict_mode_on_a_gpu_node_compares_the_real_devices(monkeypatch):
    _torchrun_env(monkeypatch, rank=0, world_size=2)
    _FakeGPUs(monkeypatch, count=2)
    with distributed("cuda", strict=True) as rt:
        assert rt.device == torch.device("cuda", 0)  # no stand-in: the real device
        with pytest.raises(
            StrictDeviceError,
            match=r"all_reduce got a tensor of shape \[1\] on cpu, but "
            r"the runtime's device is cuda:0: make it with",
        ):
            dist.all_reduce(torch.zeros(1))


# --- 3. what the library hands back is on rt.device (strict mode, P = 2) ---------------------------


def _devices(rt):
    """Where each library building block puts what it returns, as strict mode sees it."""
    from distlab.contrastive.gather import gather_library, gather_plain, gather_with_grad
    from distlab.contrastive.grad_cache import GradCache
    from distlab.contrastive.losses import clip_loss
    from distlab.contrastive.step import contrastive_loss
    from distlab.contrastive.variants import LOCAL_SUM
    from distlab.model_split import p2p
    from distlab.proof.models import TwoTower, paired_data
    from distlab.streamed.step import gather_pairs

    with strict_device(rt) as rt:
        peer = 1 - rt.rank
        z = torch.randn(3, 4, dtype=torch.float64, device=rt.device, requires_grad=True)
        got = {
            "p2p.exchange": p2p.exchange([(z, peer)], [((3, 4), peer)], torch.float64, rt.device)[0],
            "gather_plain": gather_plain(z),
            "gather_with_grad": gather_with_grad(z),
            "gather_library": gather_library(z),
            "contrastive_loss": contrastive_loss(rt, z, z * 2, 0.1, LOCAL_SUM)[0],
            "streamed.gather_pairs": gather_pairs(z.detach(), z.detach(), 6)[0],
        }
        model = TwoTower(seed=0).to(rt.device)
        x, y = (t[:4].to(rt.device) for t in paired_data(8, seed=1))
        cache = GradCache([model.encoder_x, model.encoder_y], 2, lambda a, b: clip_loss(a, b, 10.0))
        reps, _ = cache.forward_no_grad(model.encoder_x, cache.split_inputs(x, 2))
        got["GradCache.forward_no_grad"] = reps
        got["GradCache.build_cache"] = cache.build_cache(reps, reps.clone())[0][0]
        cache(x, y)
        got["a gradient GradCache accumulated"] = next(model.encoder_x.parameters()).grad
        return {name: str(t.device) for name, t in got.items()}


def test_what_the_library_returns_follows_rt_device():
    for rank_devices in spawn(_devices, 2, timeout_s=30):
        assert rank_devices == dict.fromkeys(rank_devices, str(STAND_IN)), rank_devices
