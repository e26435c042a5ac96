"""Process groups and devices: the one place distlab sets up torch.distributed.

torchrun starts one process per rank and tells each who it is through environment variables
(RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT). `distributed()` turns
them into a process group and a `Runtime`, the one answer to "who am I" that lessons and the library
pass around, and always tears the group down again.

Backend and device. On CPUs the group is gloo. On GPUs it is `"cpu:gloo,cuda:nccl"`: nccl carries
CUDA tensors, and gloo still serves the few CPU tensors a program exchanges (object lists, a flag), so
a stray CPU tensor is slow rather than fatal. The rule all the same: every collective runs on
`rt.device`, the device the rank computes on (`distlab.processes.strict` checks it in tests).

Which GPU. torchrun starts LOCAL_WORLD_SIZE ranks on a node; rank r takes `cuda:LOCAL_RANK` when it
sees at least that many GPUs. A launcher may instead bind one GPU to each rank (SLURM's
`--gpus-per-task=1`, or a wrapper that sets CUDA_VISIBLE_DEVICES=r): then every rank sees exactly one
GPU, as `cuda:0`, and that GPU is its own. `--device auto` takes it; without the binding rule it would
count one GPU for several ranks and fall back to the CPU without a word. (Two ranks bound to the same GPU
are NCCL's to refuse: "Duplicate GPU detected" at the first collective.)

Every process group gets a timeout, so a rank waiting for a message that never comes fails with an
error instead of hanging forever.

Restarts. `torchrun --max-restarts N` restarts every rank when one fails, and the restarted ranks meet
in the store of the attempt that failed (torchrun's agent keeps one store for the whole run): the keys
the dead attempt wrote are still there, gloo's peer addresses among them, and a restarted rank that
reads a dead peer's address before the live one overwrites it fails to connect (pytorch/pytorch#135712).
`attempt_store` gives every attempt keys of its own (TORCHELASTIC_RESTART_COUNT, the same on every rank
of one node's agent).
"""

from __future__ import annotations

import gc
import importlib
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from distlab.processes import reproducible
from distlab.processes.console import console, error_line
from distlab.processes.identity import Runtime
from distlab.processes.nodes import agent_stops_named, enrol, is_peer_failure, leaving, say_before_teardown
from distlab.processes.strict import strict_device

DEFAULT_TIMEOUT_S = float(os.environ.get("DISTLAB_TIMEOUT_S", "120"))
SOLO_TIMEOUT_S = float(os.environ.get("DISTLAB_SOLO_TIMEOUT_S", "900"))  # a phase rank 0 runs alone
DEVICE_CHOICES = ("auto", "cpu", "cuda")
GPU_BACKEND = "cpu:gloo,cuda:nccl"
ERROR_GRACE_S = 0.5  # how long the other ranks let rank 0 print a bad-input line first


def visible_gpus() -> int:
    """How many GPUs this process sees (after CUDA_VISIBLE_DEVICES)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def bound_to_one_gpu(gpus: int, visible: str | None) -> bool:
    """A launcher gave this rank a GPU of its own: it sees exactly one, and CUDA_VISIBLE_DEVICES (`visible`)
    names exactly one (SLURM's per-task binding). One GPU seen without the variable is a node's only GPU."""
    return gpus == 1 and visible is not None and len([v for v in visible.split(",") if v.strip()]) == 1


def choose_backend(
    requested: str, local_world_size: int, gpus: int | None = None, visible: str | None = None
) -> tuple[str, str]:
    """(backend, device type): the GPU backend when every rank on this node can have its own GPU, `gpus`
    of them seen by each (default: what this process sees) or one bound to each through CUDA_VISIBLE_DEVICES
    (`visible`), or when `--device cuda` asks for it; else ('gloo', 'cpu')."""
    if requested not in DEVICE_CHOICES:
        raise ValueError(f"--device must be one of {DEVICE_CHOICES}, got {requested!r}")
    if gpus is None:
        gpus = visible_gpus()
    enough = gpus >= local_world_size or bound_to_one_gpu(gpus, visible)
    if requested == "cuda" and not enough:
        raise ValueError(
            f"--device cuda needs one GPU per rank: {local_world_size} ranks on this node, {gpus} GPUs "
            f"(or one bound to each rank by CUDA_VISIBLE_DEVICES)"
        )
    if requested == "cuda" or (requested == "auto" and enough):
        return GPU_BACKEND, "cuda"
    return "gloo", "cpu"


def gpu_index(local_rank: int, local_world_size: int, gpus: int) -> int:
    """This rank's GPU among those it sees: its local rank when it sees one per rank, else (bound) the one."""
    return local_rank if gpus >= local_world_size else 0


def _env_int(name: str, default: int | None = None) -> int:
    value = os.environ.get(name)
    if value is None:
        if default is None:
            script = os.path.relpath(sys.argv[0]) if sys.argv and sys.argv[0] else "lessons/NN_lesson.py"
            raise ValueError(
                f"environment variable {name} is not set: launch with torchrun, "
                f"e.g. `torchrun --nproc-per-node 2 {script}`"
            )
        return default
    return int(value)


def attempt_store(world_size: int, timeout: timedelta) -> dist.Store | None:
    """torchrun's store, its keys prefixed by this attempt's number; None when not under torchrun's
    agent (init_process_group then reads MASTER_ADDR and MASTER_PORT itself)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        return None
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], _env_int("MASTER_PORT"), world_size, is_master=False, timeout=timeout
    )
    return dist.PrefixStore(f"attempt-{_env_int('TORCHELASTIC_RESTART_COUNT', 0)}", store)


@contextmanager
def distributed(
    device: str = "auto", timeout_s: float | None = None, strict: bool | None = None, deterministic: bool = False
) -> Iterator[Runtime]:
    """Initialise the default process group from torchrun's environment; destroy it on the way out.

    The group is destroyed on success and on exception alike, so a failing lesson releases its
    sockets (and, on GPUs, its communicators) before the process exits. `strict=True` (default:
    the environment variable DISTLAB_STRICT_DEVICE=1) runs the block in `distlab.processes.strict`'s strict
    device mode, where a collective on a tensor not on `rt.device` raises. `deterministic=True` (for
    a lesson that claims bit-identical runs) runs it, on a GPU, with deterministic kernels only
    (`distlab.processes.reproducible.deterministic`, entered before anything runs on the GPU).
    """
    rank, world_size = _env_int("RANK"), _env_int("WORLD_SIZE")
    local_rank = _env_int("LOCAL_RANK", rank)
    local_world_size, gpus = _env_int("LOCAL_WORLD_SIZE", world_size), visible_gpus()
    backend, kind = choose_backend(device, local_world_size, gpus, os.environ.get("CUDA_VISIBLE_DEVICES"))
    dev = torch.device("cuda", gpu_index(local_rank, local_world_size, gpus)) if kind == "cuda" else torch.device("cpu")
    if kind == "cuda":
        torch.cuda.set_device(dev)
    with reproducible.deterministic(dev) if deterministic else nullcontext():  # before the GPU runs anything
        yield from _process_group(backend, rank, world_size, local_rank, dev, timeout_s, strict)


def _process_group(
    backend: str, rank: int, world_size: int, local_rank: int, dev: torch.device, timeout_s, strict
) -> Iterator[Runtime]:
    """`distributed()`'s group: made, yielded as a Runtime (in strict mode if asked), released."""
    timeout = timedelta(seconds=timeout_s if timeout_s is not None else DEFAULT_TIMEOUT_S)
    # Every optimizer imports torch._dynamo on construction; imported for the first time while a
    # group exists, it keeps gloo's threads alive past destroy_process_group, and the process then
    # aborts at exit now and then (3 of 29 runs of lesson 04). Imported before the group: never.
    importlib.import_module("torch._dynamo")  # (`import torch._dynamo` here would shadow `torch`)
    dist.init_process_group(
        backend,
        store=attempt_store(world_size, timeout),
        rank=rank,
        world_size=world_size,
        timeout=timeout,
        device_id=dev if dev.type == "cuda" else None,
    )
    try:
        enrol(rank)  # host and pid, for a survivor's line naming the rank that died (`nodes`)
        with ExitStack() as stack:
            stack.enter_context(agent_stops_named())  # several agents: a SIGTERM says why (`nodes`)
            rt = Runtime(rank, world_size, local_rank, backend, dev)
            if strict if strict is not None else os.environ.get("DISTLAB_STRICT_DEVICE") == "1":
                rt = stack.enter_context(strict_device(rt))
            yield rt
    except Exception as err:
        if world_size > 1:
            leaving(rank)  # first: a survivor is to name only the ranks that died unannounced (`nodes`)
        if world_size > 1 and is_peer_failure(err):
            say_before_teardown(rank, err, world_size)  # before a teardown torchrun's agent may cut short (`nodes`)
        raise
    finally:
        release_process_group()


@contextmanager
def rank0_alone(rt: Runtime, what: str, limit_s: float | None = None) -> Iterator[bool]:
    """A phase rank 0 runs alone while the others wait (`with rank0_alone(rt, "part 1") as mine: if mine: ...`).

    The waiting ranks must not wait in a collective of the process group: its timeout (DEFAULT_TIMEOUT_S,
    sized for one collective) would end them on a slower machine while rank 0 is still working. They
    wait in a barrier of a group of their own, on the CPU (gloo), whose timeout is sized to the phase:
    `limit_s`, by default SOLO_TIMEOUT_S (DISTLAB_SOLO_TIMEOUT_S, 900 s). Past it every waiting rank
    raises one error that says what it waited for and which variable to raise."""
    limit = limit_s if limit_s is not None else SOLO_TIMEOUT_S
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=limit)) if rt.world_size > 1 else None
    yield rt.rank == 0
    if group is None:
        return
    try:
        dist.barrier(group=group)
    except RuntimeError as err:
        raise RuntimeError(
            f"rank {rt.rank} waited {limit:g} s for rank 0's {what}, which rank 0 runs alone, and gave up: "
            "a slower or busier machine needs longer (set DISTLAB_SOLO_TIMEOUT_S), or rank 0 failed"
        ) from err
    finally:
        dist.destroy_process_group(group)


def release_process_group(group: dist.ProcessGroup | None = None) -> None:
    """Destroy `group` (default: the default group, and with it every group) in the one order that
    cannot deadlock at exit: what holds the group in C++ first, the group last.

    Why the order matters. A gloo group's destructor waits for its worker threads, and takes the
    mutex a worker holds while it frees the collective it just finished. If Python has dropped that
    collective's tensor meanwhile, freeing it is Python's job, so the worker needs the GIL. Torch
    destroys the group through its Python handle with the GIL released: the worker gets the GIL,
    finishes, and the destructor goes on. But a DistributedDataParallel's C++ reducer (and the logger
    that points at it) holds the group too, and frees it with the GIL held: if the reducer is the
    last owner, the main thread holds the GIL and waits for the mutex while the worker holds the
    mutex and waits for the GIL, forever (the group's timeout covers collectives, not destructors).
    Lesson 27 at P = 3 hung so at exit, its DDP outliving the group in `main()`'s frame.

    So: collect garbage while the group is alive (a wrapper that only a cycle keeps dies now); drop
    the reducer and logger of every DDP that something still holds (after the group is gone the
    wrapper could not run anyway); destroy the group. Its last owner is then its Python handle.
    FSDP2 holds its groups only through Python handles, so it needs nothing more. Called again when
    there is no default group any more (a `finally` after an earlier release), it does nothing.
    """
    from torch.nn.parallel import DistributedDataParallel

    if group is None and not dist.is_initialized():
        return  # released already: nothing holds a group
    gc.collect()
    every = group is None or group == dist.GroupMember.WORLD
    for obj in gc.get_objects():
        if issubclass(type(obj), DistributedDataParallel) and (every or obj.__dict__.get("process_group") is group):
            for handle in ("logger", "reducer"):  # the two C++ owners, as DDP's own __getstate__ drops them
                obj.__dict__.pop(handle, None)
    dist.destroy_process_group(group)


def raised_by_a_check(err: BaseException) -> bool:
    """Whether `err` was raised by a check of distlab's or a lesson's own (its innermost frame is in their
    source), not by torch or Python underneath them: a ValueError from inside torch at run time is a failure
    to show with its traceback, not bad input to answer with one line."""
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None:
        return False
    source = Path(tb.tb_frame.f_code.co_filename).resolve()
    distlab = Path(__file__).resolve().parents[1]  # src/distlab, every room (this file is in processes/)
    return source.is_relative_to(distlab) or source.parent.name in ("lessons", "benchmarks")


def run_main(main: Callable[[], int]) -> None:
    """Run a lesson's `main()` and exit with its code. A ValueError that distlab's or the lesson's own checks
    raised is bad input, raised the same way on every rank before any collective: rank 0 prints it as one
    line and every rank exits 2, instead of P identical tracebacks. torchrun stops every rank once one has
    failed, so the others give rank 0 a moment to print its line before they exit. Any other error, a
    ValueError from inside torch included, is a run-time failure: its traceback, as Python shows it."""

    try:
        code = main()
    except ValueError as err:
        if not raised_by_a_check(err):
            raise
        if os.environ.get("RANK", "0") == "0":
            console.print(error_line(str(err)), soft_wrap=True)
        else:
            time.sleep(ERROR_GRACE_S)
        code = 2
    sys.exit(code)
