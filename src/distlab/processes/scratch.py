"""A temporary directory that a killed run does not leave behind (lesson 07's checkpoint, when the
learner gives no --checkpoint-dir).

How a run ends decides who can clean up. An exception or Ctrl-C (KeyboardInterrupt) unwinds the stack:
`try/finally` removes the directory. SIGTERM, what torchrun sends the survivors when one rank fails,
kills a Python process without unwinding, unless a handler turns it into an exception: `scratch_dir`
installs one (SystemExit) for as long as the directory lives. SIGKILL cannot be caught at all; so the
directory's name carries its owner's process id, `<prefix><pid>-<random>`, and every `scratch_dir`
first removes the directories of its prefix whose owner no longer runs: what a killed run left lasts
only until the next run starts. (A Python signal handler runs between bytecodes: a rank blocked in a
collective's C++ wait takes SIGTERM only when the wait returns, or torchrun's SIGKILL comes first; the
sweep covers that case too.)
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def owner_runs(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists, under another user
    return True


def sweep(prefix: str, folder: Path | None = None) -> list[Path]:
    """Remove the `prefix` directories in `folder` (the system's temporary one) whose owner is gone."""
    removed = []
    for path in Path(folder or tempfile.gettempdir()).glob(f"{prefix}*-*"):
        pid = path.name[len(prefix) :].split("-")[0]
        if path.is_dir() and pid.isdigit() and not owner_runs(int(pid)):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)  # unwinds the stack: every finally runs


@contextmanager
def scratch_dir(prefix: str, folder: Path | None = None) -> Iterator[Path]:
    """A fresh directory `<prefix><pid>-...`, removed however the block ends but by SIGKILL (whose
    leftover the next `scratch_dir` of the same prefix removes)."""
    sweep(prefix, folder)
    path = Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=folder))
    main = threading.current_thread() is threading.main_thread()  # only the main thread may set handlers
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm) if main else None
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
        if main:
            signal.signal(signal.SIGTERM, previous)
