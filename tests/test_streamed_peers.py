"""When the streamed step can name a peer that died: on gloo always, on nccl only where NCCL raises in the
caller (tests/test_streamed_open_clip.py kills a rank from inside the step). No GPU here: the nccl group is
a gloo group that answers "nccl" when asked its backend. And the naming itself: at P = 4, one rank (each of
2, 3, 0 in turn) SIGKILLed from outside while every rank steps, and every survivor's message must name
exactly that rank (benchmarks/peer_kills.py runs the same harness at P = 2-8 for the README's figures)."""

from __future__ import annotations

import multiprocessing as mp
import os
import re
import signal
import time
import warnings
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from streamed_helpers import Towers
from torch.nn.parallel import DistributedDataParallel as DDP

from distlab.processes.spawn import free_port, spawn
from distlab.streamed.safeguards import peers
from distributed_clip import distributed_backward

GPU_BACKEND = "cpu:gloo,cuda:nccl"


def _as_nccl(rt, env: dict[str, str]):
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


# -- a rank SIGKILLed from outside, at P = 4: every survivor names exactly it ------------------------

P = 4
TIMEOUT_S = 20.0  # the process group's: longer than a verdict, so no survivor fails by timing out first


def _stepping_rank(rank, world, port, reports):
    """Step until killed or failed (no torchrun: rank 0 holds the store); report the first step, then
    the error this rank saw, and exit without teardown as a lesson's rank would."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=TIMEOUT_S))
    c = 6  # pairs per rank, N = 6 P
    model, gen = DDP(Towers(scale_shape=())), torch.Generator().manual_seed(0)
    x, y = (
        torch.randn(c * world, 12, generator=gen, dtype=torch.float64),
        torch.randn(c * world, 10, generator=gen, dtype=torch.float64),
    )
    config = {"GLOBAL_BATCH_SIZE": c * world, "MICRO_BATCH_SIZE": c}
    try:
        for step in range(10_000):
            distributed_backward(model, x[rank * c : (rank + 1) * c], y[rank * c : (rank + 1) * c], config)
            if step == 0:
                reports.put((rank, "stepping"))
        message = "no error"
    except Exception as err:  # noqa: BLE001 - what the survivor saw, whatever it was
        message = f"{type(err).__name__}: {err}"
    reports.put((rank, message))
    reports.close()
    reports.join_thread()
    os._exit(0)


def named_dead(message: str) -> set[int]:
    """The ranks a survivor's message calls dead: 'rank(s) a, b died ...', or the store's holder."""
    if match := re.match(r"RuntimeError: ranks? ([\d, ]+) died", message):
        return {int(r) for r in match.group(1).split(",")}
    if re.match(r"RuntimeError: .*store is gone.*rank 0, which held the store", message):
        return {0}
    return set()


def survivors_after_killing(victim: int, world: int = P) -> dict[int, str]:
    """Launch `world` ranks, SIGKILL `victim` once every rank has stepped, and return each survivor's message."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "distlab"])  # as spawn's
    reports = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_stepping_rank, args=(r, world, port, reports)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        stepping = dict(reports.get(timeout=60) for _ in range(world))
        assert stepping == dict.fromkeys(range(world), "stepping"), stepping
        time.sleep(0.1)  # mid-step: the others are in the next step's exchanges
        os.kill(procs[victim].pid, signal.SIGKILL)
        return dict(reports.get(timeout=TIMEOUT_S + 30) for _ in range(world - 1))
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()


@pytest.mark.parametrize("victim", [2, 3, 0])
def test_every_survivor_names_exactly_the_rank_killed_at_p4(victim):
    survivors = survivors_after_killing(victim)
    assert sorted(survivors) == [r for r in range(P) if r != victim], survivors
    for rank, message in survivors.items():
        assert named_dead(message) == {victim}, (victim, rank, message)


def test_a_message_that_names_a_live_rank_too_is_caught():
    """The check above can fail: a roll call's verdict (the dead rank and a late survivor) is rejected."""
    assert named_dead("RuntimeError: ranks 1, 3 died during the streamed step's exchanges") == {1, 3} != {1}
    assert named_dead("RuntimeError: a peer died; connection reset by peer") == set()
