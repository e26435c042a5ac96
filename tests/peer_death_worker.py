"""torchrun's worker for tests/test_peer_deaths.py: a lesson run as it is, but rank VICTIM SIGKILLs itself at the
start of its CALL-th collective (every `torch.distributed` collective and point-to-point call counts), as a rank
killed from outside while the others wait for it (isend and irecv are not wrapped: `P2POp` checks that it was
given torch's own; `batch_isend_irecv`, which runs them, counts):

    torchrun --nproc-per-node 4 tests/peer_death_worker.py VICTIM CALL lessons/17_powersgd.py [flags]

Counting calls, not seconds, puts the death at the same point of the lesson on a quiet or a loaded machine."""

from __future__ import annotations

import functools
import os
import runpy
import signal
import sys
from pathlib import Path

import torch.distributed as dist

CALLS = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_to_all_single",
    "broadcast",
    "barrier",
    "send",
    "recv",
    "batch_isend_irecv",
    "all_gather_object",
    "broadcast_object_list",
)


def dying_at(call: int):
    made = [0]

    def wrap(fn):
        @functools.wraps(fn)
        def counted(*args, **kwargs):
            made[0] += 1
            if made[0] == call:
                print(f"rank {os.environ['RANK']}: SIGKILL at collective call {call}", file=sys.stderr, flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            return fn(*args, **kwargs)

        return counted

    return wrap


def main() -> None:
    victim, call, lesson, *flags = sys.argv[1:]
    if int(os.environ["RANK"]) == int(victim):
        wrap = dying_at(int(call))
        for name in CALLS:
            setattr(dist, name, wrap(getattr(dist, name)))
    sys.argv = [lesson, *flags]
    sys.path.insert(0, str(Path(lesson).resolve().parent))
    runpy.run_path(lesson, run_name="__main__")


if __name__ == "__main__":
    main()
