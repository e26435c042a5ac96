"""A rank killed under two torchrun agents on one host (`--nnodes 2 --rdzv-backend c10d` on the loopback, one
rank per agent): the survivor's own line names what died, within the process group's timeout.

torchrun's agent stops every rank of its node once one of them fails, and the workers' store is served by node
0's agent. So a rank of node 1 killed: node 0's rank survives with the store, and the streamed step's heartbeat
names the dead rank and its node (`distlab.streamed.peers`). A rank of node 0 killed: the store goes with node 0,
node 1's agent loses it and SIGTERMs its rank about a second later, before the teardown could let Python print a
traceback; the survivor's line, printed before the teardown (`runtime.say_before_teardown`), names node 0. Before
this, a survivor printed gloo's "Connection closed by peer" and nothing else (issue 37).
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


def _agents(tmp: Path) -> tuple[list[subprocess.Popen], list[Path]]:
    port, env = free_port(), dict(os.environ)
    env.update(
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


def survivor_lines(victim: int, tmp: Path) -> tuple[list[str], float]:
    """Start two agents, SIGKILL rank `victim` once both ranks have stepped; every agent reaped. The
    survivor's `[rank r]` lines, and the seconds from the kill until both agents had exited."""
    agents, logs = _agents(tmp)
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
    "victim, named",
    [
        (1, "rank 1 died during the streamed step's exchanges (on node 1 (rank 1): torchrun's agent stops"),
        (0, "node 0 (rank 0), whose torchrun agent served the store, stopped"),
    ],
)
def test_the_survivor_names_the_rank_or_node_killed_under_two_agents(victim, named, tmp_path):
    lines, elapsed = survivor_lines(victim, tmp_path)
    assert any(named in line for line in lines), lines
    assert elapsed < TIMEOUT_S, elapsed  # named, and every process gone, within the group's timeout
