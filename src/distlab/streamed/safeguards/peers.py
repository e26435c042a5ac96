"""A rank that dies in the middle of the step: named, exactly, on every rank still running.

When a rank dies (killed, out of memory, a crash) while the others wait for it in a collective, each
survivor's backend says so in its own words: gloo's "Connection closed by peer [ip]:port" or
"Connection reset by peer", a timeout once the process group's timeout has passed, NCCL's error for a
remote process that exited. None of them says which rank, and raised from inside the step they read
like a bug of the step. `naming_dead_peers` catches such an error and names the ranks whose process
stopped, in one RuntimeError chained to the backend's; when none did, the error is raised as it was.

Why a heartbeat, not a roll call. A survivor cannot tell a dead rank from a live one by who answers
in time: the survivors do not fail together. The one whose collective touched the dead rank fails at
once; a survivor that was waiting on *it* fails only when it exits (or when its collective times out),
and one that was computing fails at its next collective. A roll call ("say here within 5 s") named
those live ranks as dead; and a survivor holding the store (rank 0, outside torchrun) that left after
its own verdict took the store with it, so the later ones blamed rank 0. At P = 4, one rank SIGKILLed,
the roll call's messages named exactly the dead rank 3 times in 21. So liveness is asked of something
that runs in every live process whatever its main thread does (benchmarks/peer_kills.py, P = 2-8, one
rank killed 20 times: 83 of 83 survivor messages named exactly it):

- every process of the group runs one `Heartbeat` thread from its first step on: it adds 1 to its
  count in the process group's store every BEAT_S seconds (a collective releases the GIL while it
  waits, so a blocked rank still beats);
- a survivor that catches a peer's failure declares an incident (adds 1 to the incident count); every
  process's thread, seeing it, reads every rank's count, reads them again WINDOW_S later, and calls dead
  exactly the ranks whose count did not move and that did not leave. Each keeps its verdict in its own
  process, so a survivor that fails later, after the store has gone, still has it;
- a survivor marks itself as leaving before it raises: it stops beating when it exits, and a survivor
  judging a later incident (its own collective failed later) must not call it dead;
- the process that holds the store (rank 0, unless torchrun's agent holds it) waits before it raises
  until every live rank's thread has judged, so nobody is left without the store mid-verdict.

Every survivor's verdict is then the same set, whenever its own main thread fails. What a heartbeat
cannot see: a process alive but stuck (a deadlock in Python) keeps beating and is not named (the
backend's error is raised as it was); a rank killed before its first step never beat, and is named;
with rank 0 dead outside torchrun the store is gone too, and rank 0 is what the survivors name. Under several
torchrun agents a node's ranks stop together (its agent stops them all once one fails), so a verdict names them
all and their node; when node 0, whose agent serves the store, stops, the survivors name node 0
(`distlab.processes.nodes`; tests/test_two_agents.py kills a rank on either node of two agents).

It needs the backend's error to reach the rank's own thread, as an exception the step can catch. gloo
raises it there. NCCL by default does not: a collective only queues a kernel and returns, the error (a
timeout) is found by NCCL's watchdog thread, and under torchrun, which sets
TORCH_NCCL_ASYNC_ERROR_HANDLING=1, the watchdog then tears the process down; no exception, no naming.
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
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist

from distlab.processes.nodes import is_peer_failure, nodes_of, store_holder

BEAT_S = 0.25  # how often every process adds 1 to its count
WINDOW_S = 3.0  # a rank whose count did not move over this long has stopped
KEY = "distlab.peers"  # the store keys' prefix: KEY/beat/<rank>, KEY/incident, KEY/judged/<rank>
_warned: set[tuple[int, ...]] = set()  # groups whose "naming is off" warning this process gave
_beat: Heartbeat | None = None  # this process's heartbeat, for the current default store


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


def holds_the_store() -> bool:
    """This process serves the group's store: rank 0 of an env:// or tcp:// launch, not under torchrun's
    agent (which holds the store itself)."""
    return dist.get_rank() == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True)


class Heartbeat(threading.Thread):
    """This process's pulse in the store, and its judge of who stopped (a daemon thread; see above).

    `dead` is the last verdict (world ranks whose count did not move over WINDOW_S), `judged` the
    incident count it answered; both stay readable after the store is gone."""

    def __init__(self, store, rank: int, world_size: int) -> None:
        super().__init__(daemon=True, name="distlab-heartbeat")
        self.store, self.rank, self.world_size = store, rank, world_size
        self.judged, self.dead = 0, None
        self.running = True  # false once the store is gone or the group destroyed
        self.changed = threading.Condition()

    def counts(self) -> list[int]:
        return [int(self.store.add(f"{KEY}/beat/{r}", 0)) for r in range(self.world_size)]  # add 0: a read

    def left(self, rank: int) -> bool:
        """`rank` stopped beating because it left with its own verdict, not because it died."""
        return self.store.check([f"{KEY}/left/{rank}"])

    def run(self) -> None:
        window = None  # (when it opened, the incident count it answers, the counts then)
        try:
            while dist.is_initialized():
                self.store.add(f"{KEY}/beat/{self.rank}", 1)
                wanted = int(self.store.add(f"{KEY}/incident", 0))
                if window is None and wanted > self.judged:
                    window = (time.monotonic(), wanted, self.counts())
                elif window is not None and time.monotonic() - window[0] >= WINDOW_S:
                    still = [was == now for was, now in zip(window[2], self.counts())]
                    dead = [r for r in range(self.world_size) if still[r] and not self.left(r)]
                    self.store.set(f"{KEY}/judged/{self.rank}", str(window[1]))
                    with self.changed:
                        self.judged, self.dead, window = window[1], dead, None
                        self.changed.notify_all()
                time.sleep(BEAT_S)
        except Exception:  # noqa: BLE001 - the store is gone (its host exited): nothing left to beat into
            pass
        with self.changed:
            self.running = False
            self.changed.notify_all()

    def verdict(self) -> list[int] | None:
        """After a peer's failure: declare an incident, wait for this process's verdict on it, and (holding
        the store) for every live rank's. The ranks that stopped; None if the store went before any verdict."""
        try:
            incident = int(self.store.add(f"{KEY}/incident", 1))
        except Exception:  # noqa: BLE001 - the store is gone: the last verdict made while it lived, if any
            return self.dead
        with self.changed:  # one window, started at the next beat; a second one if an incident came meanwhile
            self.changed.wait_for(lambda: self.judged >= incident or not self.running, 3 * WINDOW_S)
        if self.dead is not None and holds_the_store():
            self.linger(incident)
        try:  # this process leaves knowingly: a survivor judging a later incident must not call it dead
            self.store.set(f"{KEY}/left/{self.rank}", "1")
        except Exception:  # noqa: BLE001 - the store is gone: nobody is left to judge
            pass
        return self.dead

    def linger(self, incident: int) -> None:
        """Keep the store up until every rank not found dead has judged `incident` (at most 2 windows)."""
        deadline = time.monotonic() + 2 * WINDOW_S
        live = [r for r in range(self.world_size) if r not in self.dead]
        while time.monotonic() < deadline:
            if all(int(self.store.add(f"{KEY}/judged/{r}", 0)) >= incident or self.left(r) for r in live):
                return
            time.sleep(BEAT_S)


def heartbeat() -> Heartbeat:
    """This process's heartbeat for the current default store, started on first use."""
    global _beat
    store = dist.distributed_c10d._get_default_store()
    if _beat is None or _beat.store is not store or not _beat.is_alive():
        _beat = Heartbeat(store, dist.get_rank(), dist.get_world_size())
        _beat.start()
    return _beat


def store_gone(err: BaseException) -> RuntimeError:
    """The error when the store went before this process had a verdict: its holder stopped (under several torchrun
    agents, node 0, whose agent serves the store: `distlab.processes.nodes`)."""
    return RuntimeError(
        "a peer died during the streamed step's exchanges, and the process group's store is gone with it "
        f"before any rank judged who stopped: {store_holder()} (backend: {str(err)[:160]})"
    )


@contextmanager
def naming_dead_peers(group) -> Iterator[None]:
    """Run a step whose exchanges are on `group`; a peer's death becomes one RuntimeError naming it."""
    ranks = tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
    off = naming_off_reason(group)
    if off is not None and ranks not in _warned:
        _warned.add(ranks)
        warnings.warn(off, RuntimeWarning, stacklevel=3)  # once per group and process
    beat = heartbeat() if off is None and dist.get_world_size() > 1 else None
    try:
        yield
    except Exception as err:
        if beat is None or not is_peer_failure(err):
            raise
        dead = beat.verdict()
        if dead is None:
            raise store_gone(err) from err
        named = [r for r in dead if r in ranks]
        if not named:
            raise  # every rank of the group still beats: the error was not a peer's death (passed on as it was)
        who = f"rank{'s' if len(named) > 1 else ''} {', '.join(map(str, named))}"
        raise RuntimeError(
            f"{who} died during the streamed step's exchanges{nodes_of(named)}: its process stopped (no heartbeat for "
            f"{WINDOW_S:g} s) while this rank, {dist.get_rank()}, waited for it; the step cannot go on "
            f"(backend: {str(err)[:160]})"
        ) from err
