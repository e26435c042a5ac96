"""lives: child processes a lesson starts, lets die and starts again, each reaped on every way out.

Lesson 20 kills an island of a DiLoCo run mid-round and starts it again. Its ranks cannot be torchrun's (the
elastic agent stops every rank when one dies), so each torchrun rank runs its island member in a child
process it owns: `Lives.start(target, *args)` starts `target(*args)` in a fresh interpreter (the spawn
method: no thread or lock of the parent, such as gloo's or a Rust runtime's, is carried over), and the child
sends back one value, or its traceback, through a pipe. A child may die without a word (SIGKILL): `Life.wait`
returns its exit code (-9 for SIGKILL). On leaving the `with Lives()` block, whatever raised (SIGTERM, which
torchrun sends every rank when one fails, included), every child still running is killed and every child is
joined (reaped), so none outlives the block; then a SIGTERM goes on to the handler the block found (under
torchrun, `distlab.processes.nodes`': the survivor's line naming the dead rank, then the stop SIGTERM makes), or,
with none, leaves as SystemExit(143). Should the parent itself be SIGKILLed, the kernel kills its children too
(Linux's parent-death signal). `pids` lists every child ever started, for a check that none is left.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import pickle
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any


def _die_with(parent: int) -> None:
    """The child asks the kernel to SIGKILL it when its parent dies, however the parent dies (Linux's
    PR_SET_PDEATHSIG = 1); if the parent is already gone, it leaves at once."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(1)


class StoppedBySignal(SystemExit):
    """SIGTERM, raised where the parent was (`signum` kept), to unwind to the block's exit."""

    def __init__(self, signum: int):
        super().__init__(128 + signum)
        self.signum = signum


def _exit_on_sigterm(signum, frame) -> None:
    raise StoppedBySignal(signum)  # unwinds the stack: the block's exit kills and reaps the children


def _run(target: Callable[..., Any], args: tuple, conn, parent: int) -> None:
    """The child: run, send (True, value) or (False, traceback) as plain pickle (tensors copied, not shared)."""
    _die_with(parent)
    try:
        conn.send_bytes(pickle.dumps((True, target(*args))))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent, then we exit
        conn.send_bytes(pickle.dumps((False, traceback.format_exc())))
    finally:
        conn.close()


class Life:
    """One child process: its pid, its exit, its one result."""

    def __init__(self, process, conn):
        self.process, self.conn = process, conn

    @property
    def pid(self) -> int:
        return self.process.pid

    def wait(self, limit_s: float) -> int:
        """The exit code once the child has ended (negative: killed by that signal); raises past `limit_s`."""
        self.process.join(limit_s)
        if self.process.exitcode is None:
            raise TimeoutError(f"child {self.pid} still running after {limit_s:.0f} s")
        return self.process.exitcode

    def result(self, limit_s: float) -> Any:
        """The child's value (waiting up to `limit_s`); its traceback raised here if it raised, or an error
        naming its exit code if it died without a word."""
        if not self.conn.poll(limit_s):
            raise TimeoutError(f"child {self.pid} sent nothing in {limit_s:.0f} s (exit code {self.process.exitcode})")
        try:
            ok, value = pickle.loads(self.conn.recv_bytes())
        except EOFError:
            raise RuntimeError(f"child {self.pid} died without a word, exit code {self.wait(10)}") from None
        if not ok:
            raise RuntimeError(f"child {self.pid} raised:\n{value}")
        self.wait(limit_s)
        return value


class Lives:
    """Every child started in a `with Lives() as lives:` block, killed and reaped when the block ends."""

    def __init__(self):
        self.context = mp.get_context("spawn")
        self.lives: list[Life] = []

    @property
    def pids(self) -> list[int]:
        return [life.pid for life in self.lives]

    def start(self, target: Callable[..., Any], *args: Any) -> Life:
        """`target(*args)` in a new process (`target` importable by name: a module-level function)."""
        ours, theirs = self.context.Pipe(duplex=False)
        process = self.context.Process(target=_run, args=(target, args, theirs, os.getpid()), daemon=True)
        process.start()
        theirs.close()  # the child holds its end; ours sees EOF when the child dies
        self.lives.append(Life(process, ours))
        return self.lives[-1]

    def __enter__(self) -> Lives:
        self.main = threading.current_thread() is threading.main_thread()  # only the main thread sets handlers
        self.previous = signal.signal(signal.SIGTERM, _exit_on_sigterm) if self.main else None
        return self

    def __exit__(self, kind, err, tb) -> None:
        for life in self.lives:
            if life.process.is_alive():
                life.process.kill()
            life.process.join()
            life.conn.close()
        if self.main:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if self.previous is None else self.previous)
            if isinstance(err, StoppedBySignal) and callable(self.previous):
                self.previous(err.signum, None)  # the children reaped, the SIGTERM goes where it went before
