"""torchrun's worker for tests/test_peer_deaths.py: a lesson run as it is, but rank VICTIM SIGKILLs itself at the
start of its CALL-th collective (every `torch.distributed` collective and point-to-point call counts), as a rank
killed from outside while the others wait for it (isend and irecv are not wrapped: `P2POp` checks that it was
given torch's own; `batch_isend_irecv`, which runs them, counts):

    torchrun --nproc-per-node 4 tests/peer_death_worker.py VICTIM CALL lessons/17_powersgd.py [flags]

Counting calls, not seconds, puts the death at the same point of the lesson on a quiet or a loaded machine.

CALL `island` is lesson 20's lost-island part: every rank runs it alone (the equalities before it skipped: they
take most of a minute, and hold no Lighthouse that outlives them), and rank VICTIM SIGKILLs itself as soon as it
has started its island member's process: rank 0 so dies as the host of torchft's Lighthouse while every island
member is starting against it."""

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


def dying_after_its_island_starts() -> None:
    """Lesson 20: this rank SIGKILLs itself once its first island member's process has started."""
    from distlab.resilience.lives import Lives

    start = Lives.start

    def start_then_die(self, *args):
        life = start(self, *args)
        print(f"rank {os.environ['RANK']}: SIGKILL at collective call island", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        return life

    Lives.start = start_then_die


def main() -> None:
    victim, call, lesson, *flags = sys.argv[1:]
    if int(os.environ["RANK"]) == int(victim):
        if call == "island":
            dying_after_its_island_starts()
        else:
            wrap = dying_at(int(call))
            for name in CALLS:
                setattr(dist, name, wrap(getattr(dist, name)))
    sys.argv = [lesson, *flags]
    sys.path.insert(0, str(Path(lesson).resolve().parent))
    if call == "island":
        straight_to_the_islands()
    runpy.run_path(lesson, run_name="__main__")  # (as __main__: its island processes import it by its path)


def straight_to_the_islands() -> None:
    """Lesson 20's main() with its equalities skipped (they return the bytes they sent: none), set up where the
    lesson hands main() to run_main."""
    from distlab.processes import runtime

    run_main = runtime.run_main

    def islands_only(main) -> None:
        main.__globals__["show_equalities"] = lambda rt, args, groups, verdict: 0
        run_main(main)

    runtime.run_main = islands_only


if __name__ == "__main__":
    main()
