"""A rank killed under two torchrun agents on one host (`--nnodes 2 --rdzv-backend c10d` on the loopback, one
rank per agent): the survivor's own line names what died, within the process group's timeout.

torchrun's agent stops every rank of its node once one of them fails, and then gives up the run, whereupon the
other node's agent stops its ranks too (SIGTERM), a second or two later; the workers' store is served by node 0's
agent. So a rank of node 1 killed: node 0's rank survives with the store, and the streamed step's heartbeat
names the dead rank and its node (`distlab.streamed.safeguards.peers`) unless its agent's SIGTERM comes first,
whose line then names node 1 (this node ran no other rank: `nodes.elsewhere`). A rank of node 0 killed: the
store goes with node 0, and the survivor's line, printed before the teardown (`runtime.say_before_teardown`),
names node 0. A lesson's own loop (DDP's all-reduce, no heartbeat; TWO_AGENTS_WORK=plain) names node 1 the same
way. Before this, a survivor printed gloo's "Connection closed by peer" and nothing else (issue 37).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from distlab.processes.spawn import free_port

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 20  # the process group's; the survivor must speak well within it


def _agents(tmp: Path, work: str) -> tuple[list[subprocess.Popen], list[Path]]:
    port, env = free_port(), dict(os.environ)
    env.update(
        TWO_AGENTS_WORK=work,
        PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests"), env.get("PYTHONPATH", "")]),
        OMP_NUM_THREADS="1",
        TWO_AGENTS_DIR=str(tmp),
        TWO_AGENTS_TIMEOUT_S=str(TIMEOUT_S),
    )
    logs = [tmp / f"agent{i}.log" for i in range(2)]
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1"]
    command += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"two{port}"]
    command += ["--monitor-interval", "0.2", str(ROOT / "tests" / "two_agents_worker.py")]
    agents = [subprocess.Popen(command, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT) for log in logs]
    return agents, logs


def survivor_lines(victim: int, tmp: Path, work: str) -> tuple[list[str], float]:
    """Start two agents, SIGKILL rank `victim` once both ranks have stepped; every agent reaped. The
    survivor's `[rank r]` lines, and the seconds from the kill until both agents had exited."""
    agents, logs = _agents(tmp, work)
    try:
        deadline = time.monotonic() + 90
        while not all((tmp / f"pid{r}").exists() for r in (0, 1)):
            assert time.monotonic() < deadline and all(a.poll() is None for a in agents), [p.read_text() for p in logs]
            time.sleep(0.2)
        time.sleep(0.3)  # mid-step
        os.kill(int((tmp / f"pid{victim}").read_text()), signal.SIGKILL)
        killed = time.monotonic()
        for agent in agents:
            agent.wait(timeout=TIMEOUT_S + 30)
        elapsed = time.monotonic() - killed
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
                agent.wait()
    text = "\n".join(log.read_text() for log in logs)
    lines = [line for line in text.splitlines() if line.startswith(f"[rank {1 - victim}] ")]
    return lines or [line for line in text.splitlines() if "Error" in line][-6:], elapsed


@pytest.mark.parametrize(
    "victim, work, named",
    [
        (1, "streamed", "node 1 (rank 1)"),  # the heartbeat's "rank 1 died ... (on node 1 (rank 1): ...)"
        (0, "streamed", "node 0 (rank 0)"),  # "node 0 (rank 0), whose torchrun agent served the store, stopped"
        (1, "plain", "node 1 (rank 1)"),
    ],
)
def test_the_survivor_names_the_rank_or_node_killed_under_two_agents(victim, work, named, tmp_path):
    lines, elapsed = survivor_lines(victim, tmp_path, work)
    assert any(named in line for line in lines), lines
    assert elapsed < TIMEOUT_S, elapsed  # named, and every process gone, within the group's timeout
