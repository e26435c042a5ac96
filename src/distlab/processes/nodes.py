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
"""

from __future__ import annotations

import os
import signal
import sys
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
_said: set[int] = set()  # ranks of this process that said their line already


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


def say_before_teardown(rank: int, err: BaseException) -> None:
    """This rank's one line about a peer's death, on stderr now, before a teardown its agent may cut short. The
    backend's own words name no rank; under several agents, when the store is gone too, node 0 is named."""
    if rank in _said:
        return
    _said.add(rank)
    words = f"[rank {rank}] {type(err).__name__}: {err}"
    if nodes() > 1 and "node " not in str(err):  # (the streamed step's verdict names the node already)
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


@contextmanager
def agent_stops_named() -> Iterator[None]:
    """Under several torchrun agents, in the main thread: the agent's SIGTERM raised as `StoppedByAgent` (unless
    the program handles SIGTERM itself)."""
    if nodes() <= 1 or not _in_main_thread() or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return
    before = signal.signal(signal.SIGTERM, stopped_by_agent)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def _in_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()
