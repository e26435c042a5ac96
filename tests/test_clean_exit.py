"""A script that ends with `distributed_clip.release_process_group()` exits; one that ends with
`dist.destroy_process_group()` while a DDP is still alive can hang forever (the usual ending of a training
script, and 6 of 12 practitioner launches in the issue that asked for this test).

The hang (the whole story is in `distlab.processes.runtime.release_process_group`): a gloo worker thread holds the
group's mutex while it frees a finished collective's tensor, which needs the GIL when Python has dropped
the tensor; DDP's C++ reducer, if it outlives the group's Python handle, destroys the group with the GIL
held and waits for that mutex. Left to chance it happens now and then; here it is made certain. Rank 0 of
two processes drops its tensor before rank 1 joins the all-reduce (rank 1 waits for rank 0's word in the
store), so rank 0's worker is the tensor's last owner; the tensor's finaliser, on that worker, waits
until the main thread is inside `destroy_process_group`, then a moment more. What follows depends on the
order alone:

- `dist.destroy_process_group(group)` with the DDP alive, then the DDP dropped: the reducer destroys the
  group holding the GIL; the worker waits for the GIL: rank 0 never exits (checked for 5 s after it began
  destroying; a clean exit takes milliseconds), and is killed.
- `release_process_group(group)`: the reducer is dropped first and the group destroyed last, through its
  Python handle with the GIL released: the worker finishes, and the same state is passed through
  RUNS times in a row (a fresh group each time), then the default group is released and both ranks exit 0.
"""

import inspect
import multiprocessing as mp
import os
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from distlab.processes.spawn import free_port
from distributed_clip import release_process_group

RUNS = 10
HANG_S = 5.0  # how long rank 0 must stay alive after it began destroying the group to count as hung
START_S = 120.0  # how long two ranks may take to start on a loaded machine


def _destroying(thread_id: int) -> bool:
    """The thread is destroying the group: inside torch's `destroy_process_group`, or at the line that
    drops the test's last handles (where the group's destructor runs, whichever order came before)."""
    frame = sys._current_frames().get(thread_id)
    if frame is not None and frame.f_code is one_exit.__code__ and frame.f_lineno == DROP_LINE:
        return True
    while frame is not None:
        if frame.f_code.co_name == "destroy_process_group":
            return True
        frame = frame.f_back
    return False


class FreedOnTheWorker:
    """Attached to the tensor whose freeing needs the GIL: runs on gloo's worker thread while it holds
    the group's mutex, and stays there until the main thread destroys the group."""

    def __init__(self, inside: threading.Event):
        self.inside, self.main = inside, threading.main_thread().ident

    def __del__(self):
        self.inside.set()
        deadline = time.monotonic() + 30
        while not _destroying(self.main) and time.monotonic() < deadline:
            time.sleep(0.01)  # lets go of the GIL
        time.sleep(0.3)  # the main thread is now in the group's destructor, waiting for this worker


def one_exit(rank: int, run: int, release: bool, destroying) -> None:
    """Build the state on a fresh two-rank group, then end it in the order asked for."""
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=30))
    ddp = DDP(torch.nn.Linear(2, 2), process_group=group)
    store = dist.distributed_c10d._get_default_store()
    if rank == 1:  # joins only once rank 0 has dropped its tensor: rank 0's worker frees it
        store.wait([f"dropped/{run}"])
        dist.all_reduce(torch.ones(4), group=group)
    else:
        inside = threading.Event()
        tensor = torch.ones(4)
        tensor.freed = FreedOnTheWorker(inside)
        dist.all_reduce(tensor, group=group, async_op=True)  # no handle kept
        del tensor
        store.set(f"dropped/{run}", "1")
        assert inside.wait(30), "the worker never freed the tensor"
    if release or rank == 1:
        release_process_group(group)
    else:
        destroying.set()
        dist.destroy_process_group(group)
    del group, ddp  # with the broken order, rank 0 hangs here: the reducer destroys the group


DROP_LINE = next(
    one_exit.__code__.co_firstlineno + k
    for k, line in enumerate(inspect.getsource(one_exit).splitlines())
    if line.strip().startswith("del group, ddp")
)


def _rank(rank: int, port: int, release: bool, destroying) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    for run in range(RUNS if release else 1):
        one_exit(rank, run, release, destroying)
    release_process_group()


def launch(release: bool) -> tuple[list, object]:
    ctx = mp.get_context("forkserver")
    # As spawn's (ignored once the server runs): DDP's first construction imports torch._dynamo, seconds.
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "distlab"])
    destroying, port = ctx.Event(), free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, release, destroying)) for r in range(2)]
    for p in procs:
        p.start()
    return procs, destroying


def reap(procs: list) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join()


def test_release_exits_where_destroying_the_group_under_a_live_ddp_hangs():
    broken, destroying = launch(release=False)
    released, _ = launch(release=True)
    try:
        assert destroying.wait(START_S), "rank 0 never reached the group's destruction"
        broken[1].join(START_S)
        broken[0].join(HANG_S)
        assert broken[1].exitcode == 0, broken[1].exitcode  # the bystander exits
        assert broken[0].is_alive(), f"rank 0 exited (code {broken[0].exitcode}): the deadlock was not reproduced"
        for p in released:
            p.join(START_S)
        assert [p.exitcode for p in released] == [0, 0], f"{RUNS} releases in a row: {[p.exitcode for p in released]}"
    finally:
        reap(broken + released)
