"""Several torchrun agents (nodes): which ranks run where, and a survivor's own line when a peer's node stops.

`torchrun --nnodes 2 --rdzv-backend c10d ...` runs one agent per node. Two facts of torchrun decide what a
survivor can know when a rank dies:

- an agent stops every rank of its node (SIGTERM) once one of them fails, so a node's ranks die together;
- the workers' store is served by the agent of node 0 (group rank 0; torchrun's c10d rendezvous hosts it there),
  so when node 0 stops, every other agent loses the store, gives up its rendezvous and SIGTERMs its own ranks,
  about a second later (1.0-1.2 s after the survivors raised, measured on a loaded 2-core machine).

So the survivor's line has to be said early: Python prints an exception's traceback only once it has left every
`finally`, and the teardown of a group whose peers are gone can outlast that second. `runtime.distributed` says a
peer's death in one line on stderr before its teardown (`say_before_teardown`), naming the node it came from where
it can (`node_stopped`), and under several agents turns the agent's SIGTERM into an exception whose line says why
(`stopped_by_agent`): node 0 when the store has gone with it, the other node when this node ran no other rank.
Which ranks a node ran: `node_ranks`, from torchrun's layout (the same --nproc-per-node on every node, ranks
numbered node by node; this rank's own RANK must fit it, or the ranks are not named).

Which rank died. The backend's words name none ("Connection closed by peer [127.0.0.1]:41858"). So every rank of
a group enrols its host and pid in the group's store when `distributed()` makes the group (`enrol`), and a survivor
that catches a peer's failure reads them back and looks at the processes on its own host (`stopped_ranks`): a pid
that no longer exists, or exists as a zombie (dead, not yet reaped by torchrun's agent, which polls every 0.1 s),
is a rank that died. It is read at once, in the survivor's `except`: the dead rank's process is gone by then (its
sockets closed when it died, which is what the survivor's collective saw), and the agent stops the survivors only
after it has seen that exit. Ranks on other hosts cannot be looked at from here and are not named; the streamed
step names them by heartbeat (`distlab.streamed.safeguards.peers`). With the store gone too (rank 0 held it,
outside torchrun) the line names the store's holder (`store_holder`).
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist

BACKEND_WORDS = (  # in the backend's error when a peer vanished or stopped answering
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "Timed out",
    "timed out",
    "NCCL",
    "ProcessGroupGloo",
)
PIDS = "distlab.nodes/pid"  # the store's keys PIDS/<rank>: '<host> <pid>' of every rank, from `enrol`
_said: set[int] = set()  # ranks of this process that said their line already
_hosts: dict[int, str] = {}  # what a rank serves the others while `hosting` says so (rank 0: torchft's Lighthouse)


def is_peer_failure(err: BaseException) -> bool:
    """The backend's error for a peer that vanished or stopped answering (not the model's), or an error that
    quotes it (the streamed step's, naming the dead rank)."""
    return isinstance(err, (dist.DistError, StoppedByAgent)) or (
        isinstance(err, RuntimeError) and any(word in str(err) for word in BACKEND_WORDS)
    )


def nodes() -> int:
    """How many torchrun agents (nodes) the run has: GROUP_WORLD_SIZE, 1 outside torchrun."""
    return int(os.environ.get("GROUP_WORLD_SIZE", "1"))


def node_ranks(node: int) -> list[int] | None:
    """The world ranks of torchrun node `node` (LOCAL_WORLD_SIZE of them, numbered node by node), or None when
    this rank's own RANK does not fit that layout."""
    env = os.environ
    per = int(env.get("LOCAL_WORLD_SIZE", "0"))
    if not per or int(env.get("RANK", -1)) != int(env.get("GROUP_RANK", -1)) * per + int(env.get("LOCAL_RANK", -1)):
        return None
    return list(range(node * per, (node + 1) * per))


def on_node(node: int) -> str:
    """'node 1 (ranks 2, 3)', or 'node 1' when its ranks are not known."""
    ranks = node_ranks(node)
    if not ranks:
        return f"node {node}"
    return f"node {node} (rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))})"


def nodes_of(ranks: list[int]) -> str:
    """Under several agents: ' (on node 1 (ranks 2, 3): ...)', the nodes `ranks` ran on; '' under one."""
    first = node_ranks(0)
    if nodes() <= 1 or not first:
        return ""
    on = ", ".join(on_node(n) for n in sorted({r // len(first) for r in ranks}))
    return f" (on {on}: torchrun's agent stops every rank of its node once one of them fails)"


def store_holder() -> str:
    """Who serves the process group's store, in words: node 0's agent, torchrun's agent, or rank 0."""
    if nodes() > 1:
        return f"{on_node(0)}, whose torchrun agent served the store, stopped"
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True):
        return "torchrun's agent, which held the store, stopped answering"
    return "rank 0, which held the store, stopped answering"


def enrol(rank: int) -> None:
    """Put this rank's host and pid in the default group's store, for a survivor's `stopped_ranks`."""
    if not dist.is_initialized():  # no group, no store: a test standing in for init_process_group has neither
        return
    dist.distributed_c10d._get_default_store().set(f"{PIDS}/{rank}", f"{socket.gethostname()} {os.getpid()}")


def _process_stopped(pid: int) -> bool:
    """Whether process `pid` of this host has died: gone, or a zombie waiting to be reaped."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")  # the state, after '(command)'
    except FileNotFoundError:
        return True
    except OSError:  # no /proc (not Linux): ask the kernel whether the pid exists
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False


def stopped_ranks(world_size: int, settle_s: float = 1.0) -> list[int] | None:
    """The ranks of the default group whose process on this host has died (`enrol`), but for those that left
    knowingly (`leaving`: a survivor that said its line); None when the store does not answer (its holder is gone)
    or no rank enrolled. A process killed closes its sockets before the kernel marks it dead, so a survivor that
    saw its collective fail may look a moment too soon: it looks again for up to `settle_s`."""
    try:
        store = dist.distributed_c10d._get_default_store()
        keys = [f"{PIDS}/{r}" for r in range(world_size)]
        if not store.check(keys):
            return None
        enrolled = [store.get(key).decode().split() for key in keys]
        left = {r for r in range(world_size) if store.check([f"{PIDS}/left/{r}"])}
    except Exception:  # noqa: BLE001 - whatever the client raises, the store is not there
        return None
    here = socket.gethostname()
    deadline = time.monotonic() + settle_s
    while True:
        dead = [
            r for r, (host, pid) in enumerate(enrolled) if host == here and r not in left and _process_stopped(int(pid))
        ]
        # A survivor marks itself before it stops, so one found stopped had marked itself by then: read the marks
        # again after the look (another survivor, stopped by the same SIGTERM, may have marked itself and gone
        # between the first read and the look).
        dead = [r for r in dead if not _left(store, r)]
        if dead or time.monotonic() > deadline:
            return dead
        time.sleep(0.02)


def _left(store, rank: int) -> bool:
    try:
        return store.check([f"{PIDS}/left/{rank}"])
    except Exception:  # noqa: BLE001 - the store is gone: no mark can be read, the rank is taken as it looked
        return False


def leaving(rank: int) -> None:
    """Mark this rank as leaving knowingly (it raised: a peer's failure, or its own error, which its traceback
    shows): no survivor is to name it among the ranks that died unannounced (killed, crashed, `os._exit`)."""
    try:
        dist.distributed_c10d._get_default_store().set(f"{PIDS}/left/{rank}", "1")
    except Exception:  # noqa: BLE001 - the store is gone: nobody is left to name it
        pass


@contextmanager
def hosting(rank: int, what: str) -> Iterator[None]:
    """While the block runs, rank `rank` serves `what` to the others (lesson 20: rank 0 hosts torchft's
    Lighthouse, which decides every quorum): a survivor's line naming it among the dead says what went with it."""
    _hosts[rank] = what
    try:
        yield
    finally:
        _hosts.pop(rank, None)


def _died(rank: int, dead: list[int], why: str) -> str:
    """The survivor's line naming the ranks whose process died (and their nodes, and what they hosted), and why
    this rank stopped."""
    who = f"rank {dead[0]}" if len(dead) == 1 else f"ranks {', '.join(map(str, dead))}"
    hosted = [(r, _hosts[r]) for r in dead if r in _hosts]
    host = "".join(f", {'the' if len(dead) == 1 else f'rank {r} the'} host of {what}" for r, what in hosted)
    return f"[rank {rank}] {who} died{host}{nodes_of(dead)}: {why}"


def dead_named(rank: int, world_size: int, err: BaseException) -> str:
    """A survivor's line about a peer's death: the ranks whose process died, or the store's holder when the store
    went with it, then the backend's own first line."""
    backend = f"{type(err).__name__}: {str(err).strip().splitlines()[0][:160] if str(err).strip() else ''}"
    dead = stopped_ranks(world_size)
    if dead is None:
        return f"[rank {rank}] a peer died and the process group's store is gone: {store_holder()} ({backend})"
    if not dead:
        return f"[rank {rank}] a peer failed, and no rank's process on this host has stopped ({backend})"
    return _died(rank, dead, f"stopped while this rank waited for it ({backend})")


def say_before_teardown(rank: int, err: BaseException, world_size: int | None = None) -> None:
    """This rank's one line about a peer's death, on stderr now, before a teardown its agent may cut short. The
    backend's own words name no rank: the line names the ranks whose process died (`dead_named`), unless `err`
    already does (the streamed step's verdict); under several agents, when the store is gone too, node 0."""
    if rank in _said:
        return
    _said.add(rank)
    if " died" in str(err) or world_size is None:
        words = f"[rank {rank}] {type(err).__name__}: {err}"
    else:
        words = dead_named(rank, world_size, err)
    if nodes() > 1 and "node " not in words:  # (the streamed step's verdict names the node already)
        words += f" ({node_stopped()})"
    print(words, file=sys.stderr, flush=True)


def node_stopped() -> str:
    """Under several agents, which node a peer's death came from, as far as this rank can tell: node 0 when the
    store has gone (its agent served it); the other node when this node runs no other rank (so the dead peer ran
    elsewhere) and there are two; else it cannot tell, and says so (the agents' own lines name the rank)."""
    group = int(os.environ.get("GROUP_RANK", "0"))
    if group != 0 and not _store_answers():
        return f"{store_holder()}, and the process group's store with it"
    return elsewhere(group) or f"a rank of this node ({on_node(group)}) or of another node failed"


def elsewhere(group: int) -> str | None:
    """'node 1 (rank 1) stopped: ...' when a peer's death can only have come from one other node: this node
    (`group`) runs no rank but this one, and the run has two nodes; None otherwise."""
    others = [node for node in range(nodes()) if node != group]
    if int(os.environ.get("LOCAL_WORLD_SIZE", "0")) != 1 or len(others) != 1:
        return None
    return f"{on_node(others[0])} stopped: torchrun's agent stops every rank of its node once one fails"


class StoppedByAgent(RuntimeError):
    """torchrun's agent SIGTERMed this rank (under several agents), with what the rank could tell of why."""


def _store_answers() -> bool:
    try:
        dist.distributed_c10d._get_default_store().check(["distlab.nodes/probe"])
        return True
    except Exception:  # noqa: BLE001 - whatever the client raises, the store is not there
        return False


def stopped_by_agent(signum: int, frame) -> None:
    """The SIGTERM handler under several agents: raise StoppedByAgent naming node 0 when the store is gone
    (this node's agent lost it: node 0 stopped), else saying which agent stopped this rank."""
    group = int(os.environ.get("GROUP_RANK", "0"))
    if group != 0 and dist.is_initialized() and not _store_answers():
        raise StoppedByAgent(
            f"{store_holder()}, and this node's agent lost the store and stopped its ranks (SIGTERM): a rank "
            f"of node 0 died (torchrun's agent stops every rank of its node once one of them fails)"
        )
    # An agent stops its ranks when one of them fails, and also when another node's agent gives up the run
    # (a rank of that node failed): which, this rank can tell only when it is its node's one rank.
    other = elsewhere(group)
    if other:
        raise StoppedByAgent(f"torchrun's agent of {on_node(group)} stopped this rank (SIGTERM), its only one: {other}")
    raise StoppedByAgent(
        f"torchrun's agent of {on_node(group)} stopped this rank (SIGTERM): a rank of this node failed, another "
        "node's agent gave up the run, or the agent was stopped"
    )


def named_then_stopped(signum: int, frame) -> None:
    """The SIGTERM handler under one agent: torchrun stops the survivors once it sees a rank exit, often before
    their own collective has failed (they were computing, or their peer was not the dead one). Say the line naming
    the ranks whose process died, if this rank has not said one, then stop as SIGTERM stops (no unwinding, the
    exit code torchrun expects)."""
    rank = int(os.environ.get("RANK", "0"))
    if rank not in _said and dist.is_initialized():
        leaving(rank)  # first: the other survivors, stopped at the same moment, must not name this one
        dead = stopped_ranks(dist.get_world_size(), settle_s=0)
        if dead:
            _said.add(rank)
            print(_died(rank, dead, "torchrun's agent stopped this rank (SIGTERM)"), file=sys.stderr, flush=True)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


@contextmanager
def agent_stops_named() -> Iterator[None]:
    """Under torchrun, in the main thread, unless the program handles SIGTERM itself: the agent's SIGTERM raised
    as `StoppedByAgent` under several agents; under one, a line naming the dead ranks before the rank stops."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not _in_main_thread():
        yield
        return
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return
    before = signal.signal(signal.SIGTERM, stopped_by_agent if nodes() > 1 else named_then_stopped)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def _in_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()
