"""Process groups, devices and processes: the one place distlab sets up torch.distributed.

torchrun starts one process per rank and tells each who it is through environment variables
(RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT). `distributed()` turns
them into a process group, picks the backend and device (nccl + one GPU per rank when this node has
enough GPUs, else gloo + CPU), and always tears the group down again. `spawn()` plays torchrun's part
inside one Python process, for tests and notebooks: it starts the ranks, hands each rank's return
value back, and re-raises a failing rank's exception with its rank and traceback.

Every process group gets a timeout, so a rank waiting for a message that never comes fails with an
error instead of hanging forever.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import multiprocessing as mp
import os
import pickle
import queue
import random
import socket
import sys
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from rich.console import Console

DEFAULT_TIMEOUT_S = float(os.environ.get("DISTLAB_TIMEOUT_S", "120"))
DEVICE_CHOICES = ("auto", "cpu", "cuda")

# Piped output (torchrun, CI, notebooks) is not a terminal; give tables room instead of 80 columns.
console = Console(width=None if Console().is_terminal else 120)


@dataclass(frozen=True)
class Runtime:
    """Who this process is in the group, and where its tensors live."""

    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: torch.device

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.world_size - 1


def choose_backend(requested: str, local_world_size: int) -> tuple[str, str]:
    """('nccl', 'cuda') when every rank on this node can have its own GPU, else ('gloo', 'cpu')."""
    if requested not in DEVICE_CHOICES:
        raise ValueError(f"device must be one of {DEVICE_CHOICES}, got {requested!r}")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if requested == "cuda" and gpus < local_world_size:
        raise ValueError(
            f"--device cuda needs one GPU per rank: {local_world_size} ranks on this node, {gpus} GPUs"
        )
    if requested == "cuda" or (requested == "auto" and gpus >= local_world_size):
        return "nccl", "cuda"
    return "gloo", "cpu"


def _env_int(name: str, default: int | None = None) -> int:
    value = os.environ.get(name)
    if value is None:
        if default is None:
            raise RuntimeError(
                f"environment variable {name} is not set: launch with torchrun, "
                "e.g. `torchrun --nproc-per-node 2 lessons/01_model_parallel.py`"
            )
        return default
    return int(value)


@contextmanager
def distributed(device: str = "auto", timeout_s: float | None = None) -> Iterator[Runtime]:
    """Initialise the default process group from torchrun's environment; destroy it on the way out.

    The group is destroyed on success and on exception alike, so a failing lesson releases its
    sockets (and, on GPUs, its communicators) before the process exits.
    """
    rank, world_size = _env_int("RANK"), _env_int("WORLD_SIZE")
    local_rank = _env_int("LOCAL_RANK", rank)
    backend, kind = choose_backend(device, _env_int("LOCAL_WORLD_SIZE", world_size))
    dev = torch.device(kind, local_rank) if kind == "cuda" else torch.device("cpu")
    if kind == "cuda":
        torch.cuda.set_device(dev)
    timeout = timedelta(seconds=timeout_s if timeout_s is not None else DEFAULT_TIMEOUT_S)
    # Every optimizer imports torch._dynamo on construction; imported for the first time while a
    # group exists, it keeps gloo's threads alive past destroy_process_group, and the process then
    # aborts at exit now and then (3 of 29 runs of lesson 04). Imported before the group: never.
    importlib.import_module("torch._dynamo")  # (`import torch._dynamo` here would shadow `torch`)
    dist.init_process_group(
        backend, rank=rank, world_size=world_size, timeout=timeout,
        device_id=dev if kind == "cuda" else None,
    )
    try:
        yield Runtime(rank, world_size, local_rank, backend, dev)
    finally:
        # A DDP model is freed only by the cycle collector; freed *after* its group is destroyed,
        # its reducer takes the process down at exit ("terminate called without an active
        # exception", about every other run on gloo). Collect while the group is still alive.
        gc.collect()
        dist.destroy_process_group()


def seed_everything(seed: int) -> None:
    """Seed Python's and torch's generators (CPU and every GPU)."""
    random.seed(seed)
    torch.manual_seed(seed)


def print0(*objects: Any, **kwargs: Any) -> None:
    """Print with rich on rank 0 only (or always, outside a process group)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        console.print(*objects, **kwargs)


def all_ranks_true(flag: bool, device: torch.device | None = None) -> bool:
    """True on every rank iff `flag` is true on every rank: one all_reduce(MIN), so ranks agree."""
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def run_main(main: Callable[[], int]) -> None:
    """Run a lesson's `main()` and exit with its code. A ValueError is bad input, raised the same
    way on every rank before any collective: rank 0 prints it as one line and every rank exits 2,
    instead of P identical tracebacks."""
    try:
        code = main()
    except ValueError as err:
        if os.environ.get("RANK", "0") == "0":
            console.print(f"[bold red]error:[/] {err}", highlight=False)
        code = 2
    sys.exit(code)


def add_runtime_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags every lesson shares."""
    parser.add_argument("--device", choices=DEVICE_CHOICES, default="auto",
                        help="auto: nccl+cuda when each rank can have a GPU, else gloo+cpu")
    parser.add_argument("--seed", type=int, default=0)
    return parser


# ---------------------------------------------------------------------------------------------
# spawn: torchrun's job, inside one Python process (tests, notebooks)
# ---------------------------------------------------------------------------------------------


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


def _child(rank, world_size, port, device, timeout_s, fn, args, kwargs, results) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
    )
    # As torchrun does: one intra-op thread per rank, or W ranks fight over the cores.
    torch.set_num_threads(1)
    failed_at = None
    try:
        with distributed(device=device, timeout_s=timeout_s) as rt:
            try:
                value = fn(rt, *args, **kwargs)
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


def spawn(fn: Callable[..., Any], world_size: int, *args: Any, device: str = "cpu",
          timeout_s: float = 60.0, limit_s: float = 600.0, **kwargs: Any) -> list[Any]:
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
    procs = [
        ctx.Process(target=_child, name=f"distlab-rank{r}",
                    args=(r, world_size, port, device, timeout_s, fn, args, kwargs, results))
        for r in range(world_size)
    ]
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
                        failures[r] = (float("-inf"), f"process exited with code {p.exitcode} and no traceback")
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
    return [values[r] for r in range(world_size)]


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
