"""Child processes a lesson kills and restarts (distlab.processes.lives), and the Lighthouse's status page
(distlab.processes.lighthouse): a child's value comes back, its traceback comes back, a child killed by SIGKILL
is named by its exit code, and leaving the block kills and reaps a child still running (its pid is gone). The
status page is read for what it shows, and a wait for what it never shows ends in one error that quotes it.
The targets are standard-library functions, so a child imports nothing of the tests."""

import os
import signal
import time

import pytest

from distlab.processes.lighthouse import lighthouse_shows
from distlab.processes.lives import Lives


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


def test_the_lighthouse_status_page_is_read_and_a_wait_that_never_ends_says_what_it_saw():
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=1)
    try:
        lighthouse_shows(server.address(), "[0 heartbeating]")
        with pytest.raises(TimeoutError, match=r"(?s)did not show '\[3 heartbeating\]'.*\[0 heartbeating\]"):
            lighthouse_shows(server.address(), "[3 heartbeating]", limit_s=0.3)
    finally:
        server.shutdown()
