"""lighthouse: torchft's coordination for a lesson's islands (lesson 20), on the loopback only.

torchft keeps a run of replica groups ("islands") alive through three parts: one `LighthouseServer` that
decides every quorum (which islands take part in the next outer step), one TCPStore per island (the island's
rendezvous), and one `Manager` per rank (asks the Lighthouse for the quorum, rebuilds the process group across
islands for each new quorum, heals a newcomer by sending it a live island's state). Here they are started the
way a lesson needs them: the Lighthouse on rank 0 at 127.0.0.1 on a free port, shut down on every way out;
the stores on each island's member 0; the Managers with a short timeout. `lighthouse_shows` reads the
Lighthouse's own status page (its dashboard, GET /status: the previous quorum, the next quorum's state, the
islands heartbeating), which is how a lesson waits for a state of the quorum instead of sleeping.
`torchft_logs` turns torchft's own log lines (every quorum, every commit, at INFO) on or off.
"""

from __future__ import annotations

import logging
import os
import time
import urllib.request
import warnings
from contextlib import contextmanager
from datetime import timedelta
from http.server import BaseHTTPRequestHandler

import torch.distributed as dist
from torch import nn

from distlab.processes.identity import Runtime
from distlab.processes.nodes import hosting

TIMEOUT = timedelta(seconds=30)  # torchft's timeouts: a collective, a quorum, a connection


def torchft_logs(show: bool) -> None:
    """torchft's log lines shown or not. Its Rust side (Lighthouse, Manager servers) reads RUST_LOG once, when
    torchft is first imported: so this runs before that, and processes started later inherit it. `manager`
    gives torchft's Python side the same level."""
    os.environ["RUST_LOG"] = "info" if show else "error"


class _QuietRequests(BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:  # torchft's checkpoint server prints every GET of a heal otherwise
        pass


def _python_side_as_rust_log() -> None:
    """torchft's Python loggers, its checkpoint server's request lines and torch's warning on the bytes a heal
    receives (a read-only buffer) quiet when RUST_LOG says error."""
    if os.environ.get("RUST_LOG") != "error":
        return
    from torchft.checkpointing import http_transport

    logging.getLogger("torchft").setLevel(logging.ERROR)
    http_transport.BaseHTTPRequestHandler = _QuietRequests  # the class its server's handler derives from
    warnings.filterwarnings("ignore", message="The given buffer is not writable")


@contextmanager
def lighthouse(rt: Runtime, **options):
    """A Lighthouse on rank 0 (127.0.0.1, a free port, `options` as LighthouseServer takes them); yields its
    address on every rank. Shut down on every way out: once every rank has left the block, or at once when the
    block raises (a rank that failed, or whose peer died, waits for nobody: a barrier with a dead rank would only
    fail, and its error hide the one that ended the block). While the block runs, a survivor's line naming
    rank 0 among the dead says it was the Lighthouse's host (`nodes.hosting`): every quorum went with it."""
    os.environ.setdefault("RUST_LOG", "error")  # torchft's Rust side logs every quorum at INFO otherwise
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(bind="127.0.0.1:0", **options) if rt.rank == 0 else None
    address = [server.address() if server else None]
    dist.broadcast_object_list(address, src=0)
    try:
        with hosting(0, "torchft's Lighthouse"):
            yield address[0]
        dist.barrier()  # every rank's Managers are gone before the Lighthouse goes
    finally:
        if server is not None:
            server.shutdown()


def island_stores(rt: Runtime, islands: int, member: int, count: int) -> tuple[list, list[list[int]]]:
    """`count` TCPStores per island, served by its member 0 (rank island * P/islands): (the stores this rank
    serves, to keep alive while they are used; every island's `count` ports)."""
    serves = count if member == 0 else 0
    mine = [dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) for _ in range(serves)]
    everyone = [None] * rt.world_size
    dist.all_gather_object(everyone, [store.port for store in mine])
    return mine, everyone[:: rt.world_size // islands]


def manager(model: nn.Module, replica: str, member: int, members: int, at: tuple[str, int], **options):
    """This rank's torchft Manager: rank `member` of the replica group `replica` (`members` ranks), the
    Lighthouse's address and the group's store port in `at`; `options` (init_sync, min_replica_size) as
    Manager takes them. Synchronous quorum: DiLoCo needs the quorum before its pseudogradients."""
    from torchft import Manager, ProcessGroupGloo

    _python_side_as_rust_log()
    return Manager(
        pg=ProcessGroupGloo(timeout=TIMEOUT),
        load_state_dict=model.load_state_dict,
        state_dict=model.state_dict,
        use_async_quorum=False,
        replica_id=replica,
        store_addr="127.0.0.1",
        store_port=at[1],
        rank=member,
        world_size=members,
        lighthouse_addr=at[0],
        hostname="127.0.0.1",
        timeout=TIMEOUT,
        quorum_timeout=TIMEOUT,
        connect_timeout=TIMEOUT,
        **options,
    )


def lighthouse_shows(address: str, text: str, limit_s: float = 60.0) -> None:
    """Wait until the Lighthouse's status page contains `text` (polled every 50 ms; no proxy: it is local)."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    deadline = time.monotonic() + limit_s
    while True:
        with opener.open(f"{address}/status", timeout=10) as page:
            status = page.read().decode()
        if text in status:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"the Lighthouse did not show {text!r} in {limit_s:g} s; it shows:\n{status}")
        time.sleep(0.05)
