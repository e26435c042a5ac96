"""`distlab.processes.scratch.scratch_dir` (lesson 07's own checkpoint directory) leaves nothing behind: removed on an
exception and on SIGTERM (torchrun's stop of the survivors) by the process itself; after SIGKILL, by the
next `scratch_dir` of the same prefix, which removes directories whose owner no longer runs and keeps
those whose owner does."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from distlab.processes.scratch import scratch_dir, sweep

PREFIX = "distlab-test-"
HOLD = (
    "import sys, time\nfrom pathlib import Path\nfrom distlab.processes.scratch import scratch_dir\n"
    "with scratch_dir(sys.argv[1], Path(sys.argv[2])) as path:\n"
    "    print(path, flush=True)\n    time.sleep(60)\n"
)


def held_then_killed(folder: Path, how: signal.Signals) -> tuple[Path, int]:
    """A process that holds a scratch directory, sent `how`; the directory and the exit code."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent / "src")}
    child = subprocess.Popen(
        [sys.executable, "-c", HOLD, PREFIX, str(folder)], stdout=subprocess.PIPE, text=True, env=env
    )
    path = Path(child.stdout.readline().strip())
    assert path.is_dir(), path
    child.send_signal(how)
    return path, child.wait(timeout=30)


def test_sigterm_removes_it_in_the_process(tmp_path):
    path, code = held_then_killed(tmp_path, signal.SIGTERM)
    assert code == 128 + signal.SIGTERM and not path.exists()


def test_after_sigkill_the_next_one_removes_it_and_keeps_a_live_owners(tmp_path):
    path, code = held_then_killed(tmp_path, signal.SIGKILL)
    assert code == -signal.SIGKILL and path.is_dir()  # nothing in the process could run
    live = tmp_path / f"{PREFIX}{os.getpid()}-mine"  # a live owner's (this process's): kept
    live.mkdir()
    with scratch_dir(PREFIX, tmp_path) as mine:
        assert not path.exists() and live.is_dir() and mine.is_dir()
    assert not mine.exists() and sweep(PREFIX, tmp_path) == []


def test_an_exception_removes_it(tmp_path):
    with pytest.raises(KeyError), scratch_dir(PREFIX, tmp_path) as path:
        (path / "file").write_text("x")
        raise KeyError("boom")
    assert not path.exists()
