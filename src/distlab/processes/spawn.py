"""spawn: torchrun's job inside one Python process, for tests and notebooks.

`spawn(fn, P)` starts P ranks, gives each the environment torchrun would (RANK, WORLD_SIZE, ...),
runs `fn(rt, *args, **kwargs)` inside `distributed()`, and hands every rank's return value back in
rank order. When a rank fails it re-raises the root cause with its rank and traceback: a rank that
died without a word first, else the earliest failure, so peers whose connection to it broke (the
echoes) are not blamed. Every child is reaped, on success, failure and timeout alike.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import pickle
import queue
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from distlab.processes.runtime import distributed


class SpawnError(RuntimeError):
    """A rank started by `spawn` raised; carries the rank and the child's traceback."""

    def __init__(self, rank: int, child_traceback: str):
        super().__init__(f"rank {rank} failed:\n{child_traceback}")
        self.rank = rank
        self.child_traceback = child_traceback


def free_port() -> int:
    """A TCP port that is free right now (the OS picks it), for the rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class _Launch:
    """What every rank of one `spawn` call is given."""

    world_size: int
    port: int
    device: str
    timeout_s: float
    fn: Callable[..., Any]
    args: tuple
    kwargs: dict
    crash_dir: str  # where each rank's faulthandler writes its stack if native code kills it


def _child(rank: int, launch: _Launch, results) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(launch.port),
        RANK=str(rank),
        WORLD_SIZE=str(launch.world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(launch.world_size),
    )
    # As torchrun does: one intra-op thread per rank, or W ranks fight over the cores.
    torch.set_num_threads(1)
    # A crash in native code (a signal: SIGSEGV, SIGABRT) leaves no Python traceback to send back; faulthandler
    # writes each thread's Python stack to a file the parent reads (this rank's stderr may be anyone's: the
    # ranks are forked from a server started by the first spawn of the process).
    crash_log = open(os.path.join(launch.crash_dir, f"rank{rank}.txt"), "w")  # noqa: SIM115 - open until exit
    faulthandler.enable(crash_log)
    failed_at = None
    try:
        with distributed(device=launch.device, timeout_s=launch.timeout_s) as rt:
            try:
                value = launch.fn(rt, *launch.args, **launch.kwargs)
            except BaseException:
                # Stamped before the group is torn down, so before any peer can notice: the parent
                # uses the stamps (CLOCK_MONOTONIC, one clock for the whole machine) to tell the
                # first failure from its echoes, peers whose connection to this rank broke.
                failed_at = time.monotonic()
                raise
        # Plain pickle copies tensor data; the queue's default would hand over shared-memory
        # handles that die with this process.
        results.put((rank, time.monotonic(), True, pickle.dumps(value)))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent, then we exit
        results.put((rank, failed_at or time.monotonic(), False, traceback.format_exc()))


_context = None


def _mp_context():
    """forkserver with torch preloaded: each rank forks from a clean server in milliseconds,
    instead of re-importing torch (spawn) or inheriting a parent's thread pools (fork)."""
    global _context
    if _context is None:
        _context = mp.get_context("forkserver")
        # torch._dynamo: every optimizer imports it on construction, a second per rank otherwise.
        _context.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "distlab"])
    return _context


def spawn(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    device: str = "cpu",
    timeout_s: float = 60.0,
    limit_s: float = 600.0,
    **kwargs: Any,
) -> list[Any]:
    """Run `fn(runtime, *args, **kwargs)` on `world_size` ranks; return the ranks' results in order.

    `timeout_s` is the process group's: how long any one collective may wait for its peers.
    `limit_s` bounds the whole run, for a rank stuck outside any collective.

    `fn` must be importable by name (defined at module level). When a rank fails, this raises
    `SpawnError` for the root cause: a rank that died without a traceback, else the earliest
    traceback (the others are usually peers whose connection to it broke). Ranks still blocked
    waiting for the failed one are terminated; every child is reaped, on success, failure and timeout.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = _mp_context()
    results = ctx.Queue()
    port = free_port()
    crash_dir = tempfile.TemporaryDirectory(prefix="distlab-spawn-")
    launch = _Launch(world_size, port, device, timeout_s, fn, args, kwargs, crash_dir.name)
    procs = [ctx.Process(target=_child, name=f"distlab-rank{r}", args=(r, launch, results)) for r in range(world_size)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + limit_s
    values: dict[int, Any] = {}
    failures: dict[int, tuple[float, str]] = {}  # rank -> (time of failure, traceback)
    first_failure: float | None = None
    try:
        while len(values) + len(failures) < world_size:
            now = time.monotonic()
            if first_failure is not None and now > first_failure + 2.0:
                break  # long enough for the echoes to arrive; ranks still blocked get terminated
            if now > deadline:
                missing = sorted(set(range(world_size)) - set(values))
                raise TimeoutError(f"ranks {missing} did not finish within {limit_s:.0f} s")
            try:
                rank, stamp, ok, payload = results.get(timeout=0.1)
            except queue.Empty:
                for r, p in enumerate(procs):
                    if r not in values and r not in failures and p.exitcode not in (None, 0):
                        # Died without a word (os._exit, a signal, a crash): it cannot be an echo.
                        failures[r] = (float("-inf"), _death_note(r, p.exitcode, crash_dir.name))
            else:
                if ok:
                    values[rank] = pickle.loads(payload)
                else:
                    failures[rank] = (stamp, payload)
            if failures and first_failure is None:
                first_failure = time.monotonic()
        if failures:
            root = min(failures, key=lambda r: (failures[r][0], r))
            others = sorted(set(failures) - {root})
            note = f"\n(ranks {others} failed after it)" if others else ""
            raise SpawnError(root, failures[root][1] + note)
    finally:
        _reap(procs, grace_s=10.0 if len(values) == world_size else 0.0)
        results.close()
        crash_dir.cleanup()
    return [values[r] for r in range(world_size)]


def _death_note(rank: int, exitcode: int, crash_dir: str) -> str:
    """What the parent can say of a rank that exited without sending a traceback: its exit code, and for a
    signal the Python stack its faulthandler wrote."""
    said = f"process exited with code {exitcode} and no traceback"
    if exitcode < 0:
        with open(os.path.join(crash_dir, f"rank{rank}.txt")) as log:
            said += f" (killed by signal {-exitcode}); its faulthandler wrote:\n{log.read().strip()}"
    return said


def _reap(procs: list, grace_s: float) -> None:
    """Join every child: finished ones get `grace_s` to exit, the rest are terminated, then killed."""
    end = time.monotonic() + grace_s
    for p in procs:
        p.join(timeout=max(0.0, end - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join()
