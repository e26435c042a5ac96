"""A rank that stops answering in the middle of the step: named, on every rank still running.

When a rank dies (killed, out of memory, a crash) while the others wait for it in a collective, each
survivor's backend says so in its own words: gloo's "Connection closed by peer [ip]:port" or
"Connection reset by peer", a timeout once the process group's timeout has passed, NCCL's error for a
remote process that exited. None of them says which rank, and raised from inside the step they read
like a bug of the step. `naming_dead_peers` catches such an error and holds a roll call through the
process group's store, which outlives the broken collective: every survivor writes "here" under this
step's key and waits up to `roll_call_seconds` (5 s, or half the group's timeout if that is shorter)
for the others. The ranks that never answer are named in one RuntimeError, chained to the backend's;
when every rank answers, the error was something else, and it is raised as it was.
The roll call's verdict is each survivor's own: a survivor that reaches the roll call only after that
window (it was computing, not waiting) may see the early ones as answered and the early ones may have
named it too; a rank that hung rather than died reads as stopped answering, which it has.

It needs the backend's error to reach the rank's own thread, as an exception the step can catch. gloo
raises it there. NCCL by default does not: a collective only queues a kernel and returns, the error (a
timeout) is found by NCCL's watchdog thread, and under torchrun, which sets
TORCH_NCCL_ASYNC_ERROR_HANDLING=1, the watchdog then tears the process down; no exception, no roll call.
(torchrun stops the survivors first in any case, when it sees the dead rank exit, and its own report names
that rank.) On an nccl group the naming works only when the error is raised in the caller: with
TORCH_NCCL_BLOCKING_WAIT=1 (every wait blocks the host until its collective is done or timed out, which
costs the overlap of communication with compute) or TORCH_NCCL_ASYNC_ERROR_HANDLING=2 (the watchdog
aborts the communicators and leaves the process alive, so the next wait raises), either set before the
group is made. `naming_off_reason` says which case a group is in, and the step warns once when it is off.
Neither nccl case was run here: one GPU allows only P = 1.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist

BACKEND_WORDS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "Timed out",
    "timed out",
    "NCCL",
    "ProcessGroupGloo",
)
ROLL_CALL_S = 5.0
_calls: dict[tuple[int, ...], int] = {}  # how many steps this process ran in each group: the roll call's key


def is_peer_failure(err: BaseException) -> bool:
    """The backend's error for a peer that vanished or stopped answering (not the model's)."""
    return isinstance(err, dist.DistError) or (
        isinstance(err, RuntimeError) and any(word in str(err) for word in BACKEND_WORDS)
    )


def naming_off_reason(group) -> str | None:
    """Why a dead peer on `group` cannot be named from this rank (None: it can; see above)."""
    if "nccl" not in dist.get_backend(group) or dist.get_world_size(group) == 1:
        return None
    handling = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "unset")
    if os.environ.get("TORCH_NCCL_BLOCKING_WAIT") == "1" or handling == "2":
        return None
    return (
        "naming a dead peer is off on this nccl group: NCCL reports a dead peer on its watchdog thread, which "
        f"ends this process (TORCH_NCCL_ASYNC_ERROR_HANDLING={handling}); torchrun's report names the rank "
        "that failed first. Set TORCH_NCCL_ASYNC_ERROR_HANDLING=2 or TORCH_NCCL_BLOCKING_WAIT=1 before the "
        "group is made to have the step name it."
    )


def roll_call_seconds(store) -> float:
    return min(ROLL_CALL_S, store.timeout.total_seconds() / 2)


def missing_ranks(ranks: tuple[int, ...], key: str) -> list[int]:
    """Say "here" under `key`, wait for the other `ranks` to, and return those that never did."""
    store = dist.distributed_c10d._get_default_store()
    store.set(f"{key}/{dist.get_rank()}", "here")
    deadline = time.monotonic() + roll_call_seconds(store)
    while True:
        missing = [r for r in ranks if not store.check([f"{key}/{r}"])]
        if not missing or time.monotonic() > deadline:
            return missing
        time.sleep(0.05)


@contextmanager
def naming_dead_peers(group) -> Iterator[None]:
    """Run a step whose exchanges are on `group`; a peer's death becomes one RuntimeError naming it."""
    ranks = tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
    call = _calls[ranks] = _calls.get(ranks, -1) + 1
    if call == 0 and (reason := naming_off_reason(group)) is not None:
        warnings.warn(reason, RuntimeWarning, stacklevel=3)  # once per group and process
    try:
        yield
    except Exception as err:
        if not is_peer_failure(err):
            raise
        try:
            missing = missing_ranks(ranks, f"distlab.streamed/{'-'.join(map(str, ranks))}/{call}")
        except Exception:  # noqa: BLE001 - the store is gone too: its host died
            raise RuntimeError(
                "a peer died during the streamed step's exchanges, and so did the process "
                "group's store (held by rank 0 unless torchrun's agent holds it): rank 0 "
                f"stopped answering, or the whole job is going down (backend: {err})"
            ) from err
        if not missing:
            raise  # every rank answered: the error was not a peer's death (it is passed on as it was)
        who = f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} "
        raise RuntimeError(
            f"{who}stopped answering during the streamed step's exchanges: a peer died (or "
            f"hung) while this rank, {dist.get_rank()}, waited for it; the step cannot go on "
            f"(backend: {str(err)[:160]})"
        ) from err
