"""Survivors name the dead: at P = 4 under torchrun, rank 2 of lessons 17, 18 and 19 SIGKILLs itself at its 6th
collective (tests/peer_death_worker.py), and every survivor line (`[rank r] ...` on stderr) names exactly rank 2.

Each survivor says it in one of two ways (`distlab.processes.nodes`): its own collective failed with the backend's
words (which name no rank), and `distributed()` names the ranks whose process on this host died, read from the pids
every rank enrolled in the store; or torchrun's agent stopped it first (SIGTERM), and its handler says the same
before the rank stops. A survivor that raised leaves knowingly, so the others never count it among the dead. At
least one survivor must speak (all three do on a quiet machine; a survivor the agent stops inside a long C call
may stop silently).

Lesson 20's rank 0 hosts torchft's Lighthouse: killed in the lost-island part (run alone), each survivor's line
names it as the Lighthouse's host, and no survivor prints a traceback (its island processes reaped first)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from helpers import ROOT

P, VICTIM, CALL = 4, 2, 6
LINE = re.compile(r"^\[rank (\d+)\] (.*)$")
NAMED = re.compile(r"^ranks? ([\d, ]+) died")


def killed_run(lesson: str, victim: int = VICTIM, call: int | str = CALL, *flags: str) -> str:
    """The stderr of `lesson` at P ranks when rank `victim` dies at its `call`-th collective."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={P}"]
    command += [str(ROOT / "tests" / "peer_death_worker.py"), str(victim), str(call), str(ROOT / "lessons" / lesson)]
    run = subprocess.run([*command, *flags], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode != 0 and f"rank {victim}: SIGKILL at collective call {call}" in run.stderr, run.stderr[-3000:]
    return run.stderr


def survivor_lines(stderr: str) -> dict[int, str]:
    """Each survivor's `[rank r]` line."""
    return {int(m.group(1)): m.group(2) for line in stderr.splitlines() if (m := LINE.match(line))}


@pytest.mark.parametrize("lesson", ["17_powersgd.py", "18_async_tensor_parallel.py", "19_dualpipe.py"])
def test_a_killed_rank_is_named_in_the_survivors_own_lines(lesson):
    lines = survivor_lines(killed_run(lesson))
    assert lines and VICTIM not in lines, lines
    for rank, line in lines.items():
        named = NAMED.match(line)
        assert named and {int(r) for r in named.group(1).split(",")} == {VICTIM}, (rank, line)


def test_the_lighthouse_s_host_is_named_when_it_dies():
    """Lesson 20's lost-island part (alone, F = 2), rank 0 SIGKILLed as its island member starts: every survivor
    that speaks names rank 0 as the host of torchft's Lighthouse, in its one line, with no traceback after it
    (before, gloo's "Connection closed by peer" from the Lighthouse block's closing barrier)."""
    stderr = killed_run("20_diloco.py", 0, "island", "--fragments", "2")
    lines = survivor_lines(stderr)
    assert lines and 0 not in lines, lines
    assert not re.search(r"^\[rank\d+\]: Traceback", stderr, re.MULTILINE), stderr[-3000:]
    for rank, line in lines.items():
        assert line.startswith("rank 0 died, the host of torchft's Lighthouse: "), (rank, line)
