"""Child processes a lesson kills and restarts (distlab.resilience.lives), and the Lighthouse's status page
(distlab.resilience.lighthouse): a child's value comes back, its traceback comes back, a child killed by SIGKILL
is named by its exit code, and leaving the block kills and reaps a child still running (its pid is gone), also
when the parent is stopped by SIGTERM (as torchrun stops ranks), whose handler from before the block then runs;
a parent SIGKILLed takes its children with it. The
status page is read for what it shows, and a wait for what it never shows ends in one error that quotes it.
The Lighthouse a block started is shut down when the block raises (its port closed). The children's targets
are standard-library functions, so a child imports nothing of the tests."""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from distlab.processes.spawn import spawn
from distlab.resilience.lighthouse import lighthouse, lighthouse_shows
from distlab.resilience.lives import Lives, StoppedBySignal


def test_a_value_a_traceback_and_a_kill_come_back():
    with Lives() as lives:
        value = lives.start(os.getpid)
        raised = lives.start(int, "not a number")
        killed = lives.start(signal.raise_signal, signal.SIGKILL)
        assert value.result(60) == value.pid  # the child's own pid: it ran in the child
        with pytest.raises(RuntimeError, match="invalid literal for int"):
            raised.result(60)
        assert killed.wait(60) == -signal.SIGKILL
        with pytest.raises(RuntimeError, match="died without a word, exit code -9"):
            killed.result(60)
    assert len(set(lives.pids)) == 3


def test_leaving_the_block_kills_and_reaps_a_child_still_running():
    with pytest.raises(KeyError), Lives() as lives:
        lives.start(time.sleep, 600)
        raise KeyError("the block fails while the child sleeps")
    (pid,) = lives.pids
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # killed and reaped: not even a zombie


PARENT = """
import os, sys, time
from distlab.resilience.lives import Lives, StoppedBySignal
with Lives() as lives:  # the child says it runs (a file), then sleeps; the parent prints its pid and sleeps
    lives.start(exec, f"import pathlib, time; pathlib.Path({sys.argv[1]!r}).touch(); time.sleep(600)")
    while not os.path.exists(sys.argv[1]):
        time.sleep(0.02)
    print(lives.pids[0], flush=True)
    time.sleep(600)
"""


def running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie waits for whoever adopted it; it runs nothing)."""
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; the parent-death signal is Linux's")
@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_a_child_does_not_outlive_its_parent(stop, tmp_path):
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(tmp_path / "ready")], stdout=subprocess.PIPE, text=True
    )
    child = int(parent.stdout.readline())
    assert running(child)
    parent.send_signal(stop)
    assert parent.wait(30) == (128 + stop if stop == signal.SIGTERM else -stop)
    deadline = time.monotonic() + 10
    while running(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not running(child)


def test_a_sigterm_goes_on_to_the_handler_the_block_found_once_its_children_are_reaped():
    """Under torchrun that handler says the survivor's line naming the dead rank (`distlab.processes.nodes`); here
    it records whether the block's child was still running when it was called."""
    seen = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append((signum, running(lives.pids[0]))))
    try:
        with pytest.raises(StoppedBySignal), Lives() as lives:
            lives.start(time.sleep, 600)
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(60)  # the signal's handler raises in here
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert seen == [(signal.SIGTERM, False)]  # called once, the child killed and reaped before


def test_the_lighthouse_status_page_is_read_and_a_wait_that_never_ends_says_what_it_saw():
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=1)
    try:
        lighthouse_shows(server.address(), "[0 heartbeating]")
        with pytest.raises(TimeoutError, match=r"(?s)did not show '\[3 heartbeating\]'.*\[0 heartbeating\]"):
            lighthouse_shows(server.address(), "[3 heartbeating]", limit_s=0.3)
    finally:
        server.shutdown()


def _listening(address: str) -> bool:
    host, port = address.removeprefix("http://").rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=2).close()
    except OSError:
        return False
    return True


def _lighthouse_after_a_failure(rt) -> tuple[bool, bool]:
    """In the rank itself (a Lighthouse dies with its process anyway): is the block's Lighthouse still listening
    once the block has raised; and is a Lighthouse kept alive (the wrong twin) seen listening?"""
    from torchft.coordination import LighthouseServer

    with pytest.raises(KeyError), lighthouse(rt, min_replicas=1) as address:
        raise KeyError("the block fails with the Lighthouse up")
    kept = LighthouseServer(bind="127.0.0.1:0", min_replicas=1)
    return _listening(address), _listening(kept.address())


def test_the_lighthouse_is_shut_down_when_its_block_raises():
    assert spawn(_lighthouse_after_a_failure, 1) == [(False, True)]
