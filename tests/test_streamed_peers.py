"""When the streamed step can name a peer that died: on gloo always, on nccl only where NCCL raises in the
caller (tests/test_streamed_open_clip.py kills a rank on gloo and checks the name). No GPU here: the nccl
group is a gloo group that answers "nccl" when asked its backend."""

from __future__ import annotations

import warnings

import pytest
import torch.distributed as dist

from distlab.spawn import spawn
from distlab.streamed import peers

GPU_BACKEND = "cpu:gloo,cuda:nccl"


def _as_nccl(rt, env: dict[str, str]):
    import os

    os.environ.update(env)
    dist.get_backend = lambda group=None: GPU_BACKEND
    reason = peers.naming_off_reason(None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):  # two steps: one warning
            with peers.naming_dead_peers(None):
                pass
    return reason, [str(w.message) for w in caught]


@pytest.mark.parametrize(
    "env, off",
    [
        ({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}, True),  # torchrun's: the watchdog ends the process
        ({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}, False),  # the watchdog aborts; the next wait raises here
        ({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "TORCH_NCCL_BLOCKING_WAIT": "1"}, False),
    ],
)
def test_on_nccl_the_naming_needs_the_error_raised_in_the_caller(env, off):
    for reason, caught in spawn(_as_nccl, 2, env):
        assert (reason is not None) == off and caught == ([reason] if off else [])
        if off:
            assert "TORCH_NCCL_ASYNC_ERROR_HANDLING=1" in reason and "torchrun's report names the rank" in reason


def _on_gloo(rt):
    return peers.naming_off_reason(None)


def test_on_gloo_the_naming_is_on():
    assert spawn(_on_gloo, 2) == [None, None]
