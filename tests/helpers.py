"""What the tests share (CS336's tests/common.py is the model): tiny runners and checks that several
test files need. No test file imports another test file; what two of them need lives here."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable



from distlab.spawn import spawn

ROOT = Path(__file__).resolve().parent.parent
LESSONS = ROOT / "lessons"


def _error_of(rt, fn: Callable[..., Any], args: tuple, kwargs: dict) -> str | None:
    """Run `fn(rt, *args, **kwargs)` on this rank; the ValueError's message, or None if none."""
    try:
        fn(rt, *args, **kwargs)
    except ValueError as err:
        return str(err)
    return None


def errors_on_every_rank(fn: Callable[..., Any], world_size: int, *args: Any, **kwargs: Any) -> list[str | None]:
    """Each rank's ValueError message (None where `fn` returned), in rank order."""
    return spawn(_error_of, world_size, fn, args, kwargs)


def assert_same_error_on_every_rank(fn: Callable[..., Any], world_size: int, *args: Any,
                                    match: str, **kwargs: Any) -> str:
    """Bad input must be one clear error, raised the same way on every rank (so none hangs in a
    collective waiting for a rank that gave up): every rank raises ValueError with one message
    containing `match`. Returns the message."""
    messages = errors_on_every_rank(fn, world_size, *args, **kwargs)
    assert all(m is not None for m in messages), f"some ranks raised nothing: {messages}"
    assert len(set(messages)) == 1, f"ranks disagree: {messages}"
    assert match in messages[0], f"{match!r} not in {messages[0]!r}"
    return messages[0]


class CommHookCounter:
    """A DDP comm hook that counts the all-reduces DDP launches (one per bucket) and then does
    exactly what DDP would: average the bucket over the ranks.

        counter = CommHookCounter(); ddp_model.register_comm_hook(None, counter)
    """

    def __init__(self) -> None:
        self.calls = 0
        # DDP reads a hook's name (to log it and to spot its bf16 hooks), which an instance lacks.
        self.__name__ = self.__qualname__ = type(self).__name__

    def __call__(self, state, bucket):
        import torch.distributed as dist

        self.calls += 1
        tensor = bucket.buffer().div_(dist.get_world_size())
        return dist.all_reduce(tensor, async_op=True).get_future().then(lambda fut: fut.value()[0])


def torchrun(lesson: str, nproc: int, *args: str, timeout: float = 300, columns: int | None = None):
    """Run `lessons/<lesson>` under torchrun, output captured; returns the CompletedProcess."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if columns is not None:
        env["COLUMNS"] = str(columns)
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", str(nproc), str(LESSONS / lesson), *args],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


def no_ellipsis(text: str) -> bool:
    """No table cell cut short: rich marks a cut with '\u2026'."""
    return "\u2026" not in text

