"""Every error the streamed step and its loss modules raise ends with how to exit cleanly.

An error from a training step usually ends the script, and the usual last line of a script,
`dist.destroy_process_group()`, can hang the process forever when a DistributedDataParallel is still
alive: its C++ reducer then destroys the group holding the GIL while a gloo worker waits for the GIL
(`distlab.processes.runtime.release_process_group` tells the whole story; tests/test_clean_exit.py makes it
happen). `distributed_clip.release_process_group()` ends in the order that cannot hang. So the hint
goes where a user reads first: at the end of the error itself.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

HINT = (
    "; before exiting, call distributed_clip.release_process_group() "
    "(dist.destroy_process_group() while a DDP is alive can hang at exit)"
)
HINTED = (ValueError, RuntimeError, FloatingPointError)  # what the step raises (RuntimeError: a rank's forward, a peer)


def with_hint(err: BaseException) -> BaseException:
    """`err` with the hint at the end of its message, once (the message is its first argument)."""
    if err.args and isinstance(err.args[0], str) and HINT not in err.args[0]:
        err.args = (err.args[0] + HINT, *err.args[1:])
    return err


@contextmanager
def hinting_release() -> Iterator[None]:
    """Re-raise the step's errors as they are (same type, traceback and cause), the hint appended."""
    try:
        yield
    except HINTED as err:
        raise with_hint(err)  # noqa: B904 - the same exception object: its cause and traceback are kept
