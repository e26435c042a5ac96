"""Strict device mode (`distlab.processes.strict`): a collective on a tensor that is not on `rt.device` raises,
so a GPU run cannot meet a device mismatch that the CPU suite did not.

On a CPU machine strict mode names the CPU twice: `rt.device` becomes `cpu:0`, the stand-in for the
GPU, and plain `cpu` is the host, where a tensor made without `device=` lives on a GPU machine.
Here the mode itself, in this process (no group is needed: a refused collective raises before it
communicates); tests/test_strict_device_ranks.py runs it on P = 2 ranks.
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from helpers import strict_mode_off as _is_off
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distlab.processes.identity import Runtime
from distlab.processes.runtime import distributed
from distlab.processes.strict import HOST, STAND_IN, StrictDeviceError, is_host, strict_device

ROOT = Path(__file__).resolve().parent.parent
ONE_RANK = Runtime(rank=0, world_size=1, local_rank=0, backend="gloo", device=torch.device("cpu"))


# --- the mode, in this process ---------------------------------------------------------------------


def test_host_or_placed_follows_how_a_tensor_was_made():
    with strict_device(ONE_RANK) as rt:
        assert rt.device == STAND_IN and STAND_IN != HOST
        placed = torch.zeros(2, device=rt.device)
        made = torch.tensor([1.0])
        host = {
            "torch.tensor without device": made,
            "zeros, arange, from_numpy": torch.cat([torch.zeros(1), torch.arange(1.0), torch.from_numpy(np.ones(1))]),
            "device='cpu'": torch.ones(2, device="cpu"),
            "a module's parameter": nn.Linear(2, 2).weight,
            "an op on host tensors": made * 2 + 1,
            "a view of a host tensor": made[:1],
            "placed.cpu()": placed.cpu(),
            "placed.to('cpu')": placed.to("cpu"),
            "like a host tensor": torch.zeros_like(made),
        }
        on_device = {
            "device=rt.device": placed,
            "host.to(rt.device)": made.to(rt.device),
            "host.to(placed)": made.to(placed),
            "device=placed.device": torch.zeros(2, device=placed.device),
            "like a placed tensor": torch.empty_like(placed),
            "an op with a placed input": placed * made.sum(),
            "module.to(rt.device)": nn.Linear(2, 2).to(rt.device).weight,
            "a deep copy of a placed module": copy.deepcopy(nn.Linear(2, 2).to(rt.device)).bias,
            "placed.double()": placed.double(),
        }
        for what, t in host.items():
            assert is_host(t) and t.device == HOST, what
        for what, t in on_device.items():
            assert not is_host(t) and t.device == rt.device, what
        # As on a GPU: a move copies and leaves the original where it was; a no-op move is a no-op.
        assert is_host(made) and not is_host(placed)
        assert placed.to(rt.device) is placed and made.cpu() is made
        assert made.to(rt.device).data_ptr() != made.data_ptr()
    assert _is_off()


COLLECTIVES = {
    "all_reduce": lambda t, p: dist.all_reduce(t),
    "broadcast": lambda t, p: dist.broadcast(t, src=0),
    "all_gather": lambda t, p: dist.all_gather([p, p], t),
    "all_gather_into_tensor": lambda t, p: dist.all_gather_into_tensor(p, t),
    "reduce_scatter_tensor": lambda t, p: dist.reduce_scatter_tensor(p, t),
    "all_to_all_single": lambda t, p: dist.all_to_all_single(p, t),
    "send": lambda t, p: dist.send(t, dst=1),
    "irecv": lambda t, p: dist.irecv(t, src=1),
    "reduce": lambda t, p: dist.reduce(t, dst=0),
}


@pytest.mark.parametrize("name", COLLECTIVES)
def test_a_collective_refuses_a_host_tensor_naming_itself_and_both_devices(name):
    with strict_device(ONE_RANK) as rt:
        placed = torch.zeros(2, device=rt.device)
        with pytest.raises(
            StrictDeviceError,
            match=rf"torch\.distributed\.{name} got a tensor of shape "
            r"\[2\] on cpu, but the runtime's device is cpu:0",
        ):
            COLLECTIVES[name](torch.ones(2), placed)
        if name.startswith(("all_gather", "reduce_scatter", "all_to_all")):  # the output side too
            with pytest.raises(StrictDeviceError, match=name):
                COLLECTIVES[name](placed, torch.zeros(2))


def test_an_op_mixing_host_and_device_tensors_is_refused_as_a_gpu_would():
    with strict_device(ONE_RANK) as rt:
        layer = nn.Linear(2, 3).to(rt.device)
        with pytest.raises(
            StrictDeviceError,
            match=r"torch\.nn\.functional\.linear \(beside a tensor on cpu:0\) "
            r"got a tensor of shape \[4, 2\] on cpu",
        ):
            layer(torch.randn(4, 2))
        with pytest.raises(StrictDeviceError, match=r"torch\.cat"):
            torch.cat([torch.zeros(2, device=rt.device), torch.zeros(2)])
        # What a GPU takes beside its tensors: 0-dim host tensors, host indices, copies and moves.
        placed, index = torch.arange(6.0, device=rt.device), torch.tensor([0, 2])
        placed[index] = placed[index] * torch.tensor(2.0)
        placed.copy_(torch.ones(6))
        torch.tensor_split(placed, torch.tensor([2, 4]))
        layer(torch.randn(4, 2).to(rt.device))


def test_a_dispatch_mode_inside_strict_mode_changes_nothing():
    # PeakMemory sees every aten op with its device resolved (device=cpu): strict mode must not
    # take those for tensors made on the host.
    from distlab.proof.memory import PeakMemory

    with strict_device(ONE_RANK) as rt:
        placed = torch.zeros(3, device=rt.device)
        with PeakMemory() as mem:
            doubled, made = placed * 2, torch.zeros(3)
        assert mem.peak_bytes > 0 and not is_host(doubled) and is_host(made)


def test_ddp_refuses_a_module_built_without_a_device():
    with strict_device(ONE_RANK):
        with pytest.raises(
            StrictDeviceError,
            match=r"DistributedDataParallel \(parameter 'weight' of "
            r"Linear\) got a tensor of shape \[3, 2\] on cpu",
        ):
            DDP(nn.Linear(2, 3))


def test_strict_mode_leaves_nothing_behind_and_does_not_nest():
    originals = {name: getattr(dist, name) for name in ("all_reduce", "isend", "all_gather_object")}
    ddp_init = DDP.__init__
    with pytest.raises(RuntimeError, match="already on"):
        with strict_device(ONE_RANK):
            assert not _is_off()
            with strict_device(ONE_RANK):
                pass
    assert _is_off() and DDP.__init__ is ddp_init
    assert all(getattr(dist, name) is fn for name, fn in originals.items())


def _fake_group(monkeypatch, env_strict: str | None) -> None:
    """`distributed()` without a real process group: torchrun's variables, init/destroy as no-ops."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    if env_strict is None:
        monkeypatch.delenv("DISTLAB_STRICT_DEVICE", raising=False)
    else:
        monkeypatch.setenv("DISTLAB_STRICT_DEVICE", env_strict)
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: None)
    monkeypatch.setattr(dist, "destroy_process_group", lambda *a, **k: None)


@pytest.mark.parametrize(
    "env, strict, on",
    [(None, None, False), ("0", None, False), ("1", None, True), (None, True, True), ("1", False, False)],
)
def test_distributed_turns_strict_mode_on_by_flag_or_environment(monkeypatch, env, strict, on):
    _fake_group(monkeypatch, env)
    with distributed("cpu", strict=strict) as rt:
        assert (rt.device == STAND_IN) is on and _is_off() is not on
    assert _is_off()
