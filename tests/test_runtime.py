"""spawn and process-group setup: results come back in rank order, a failing rank is named, none hang."""

import gc
import os
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from distlab.processes.runtime import GPU_BACKEND, choose_backend, release_process_group
from distlab.processes.spawn import SpawnError, free_port, spawn


def _rank_and_sum(rt, offset):
    t = torch.tensor([float(rt.rank)])
    dist.all_reduce(t)
    return rt.rank + offset, rt.world_size, t.item()


def _fail_on_rank_one(rt):
    if rt.rank == 1:
        raise RuntimeError("boom on purpose")
    # The others block on a message rank 1 will never send: spawn must not wait for the group's
    # timeout, let alone forever.
    t = torch.zeros(1)
    dist.recv(t, src=1)


def _exit_hard(rt):
    if rt.rank == 0:
        import os

        os._exit(3)
    dist.barrier()


class _SlowToFree:
    """Freed on gloo's worker thread, it lets go of the GIL (as Python does every few milliseconds)
    until the main thread is freeing the group, holding the worker's mutex all the while."""

    def __init__(self, inside: threading.Event, freeing: threading.Event):
        self.inside, self.freeing = inside, freeing

    def __del__(self):
        self.inside.set()
        self.freeing.wait(30)  # set by the main thread right before it frees the group ...
        time.sleep(1.0)  # ... which it is doing by now, while this worker holds the mutex


def _ddp_outlives_its_group(rt):
    """The exit-hang's shape, made certain instead of one run in three: a DDP still held when its
    group is released, while a gloo worker frees a collective's tensor that Python has dropped."""
    group = dist.new_group(backend="gloo", timeout=__import__("datetime").timedelta(seconds=30))
    ddp = DDP(torch.nn.Linear(2, 2), process_group=group)
    inside, freeing = threading.Event(), threading.Event()
    tensor = torch.ones(4)
    tensor.slow = _SlowToFree(inside, freeing)
    dist.all_reduce(tensor, group=group, async_op=True)  # no handle kept: the worker frees the tensor
    del tensor
    assert inside.wait(30), "the worker never freed the tensor"
    # Set before the release, not after: set after, the worker waited out its 30 s inside the
    # group's destructor in every run (the release waits for it), which proved nothing more.
    freeing.set()
    release_process_group(group)  # what distributed() runs on the way out, for this group
    del group, ddp
    gc.collect()  # a reducer still owning the group would destroy it here: hang
    return "exited"


def test_release_frees_ddp_before_its_group_so_exit_cannot_hang():
    # The release drops DDP's reducer before it destroys the group. In the other order (the group
    # destroyed while the reducer still holds it) both ranks hang in ~ProcessGroupGloo and spawn gives
    # up at its limit (checked by hand; a test that hangs on purpose would cost the suite 90 s).
    assert spawn(_ddp_outlives_its_group, 2, timeout_s=30, limit_s=90) == ["exited", "exited"]


def test_spawn_returns_each_ranks_result_in_order():
    assert spawn(_rank_and_sum, 3, 10) == [(10, 3, 3.0), (11, 3, 3.0), (12, 3, 3.0)]


def test_spawn_reports_failing_rank_with_traceback_and_does_not_hang():
    start = time.monotonic()
    with pytest.raises(SpawnError) as info:
        spawn(_fail_on_rank_one, 3, timeout_s=60)
    assert info.value.rank == 1
    assert "boom on purpose" in str(info.value) and "Traceback" in info.value.child_traceback
    assert time.monotonic() - start < 30, "the blocked ranks should be terminated, not waited for"


def test_spawn_reports_a_rank_that_dies_without_a_traceback():
    with pytest.raises(SpawnError, match="exited with code 3") as info:
        spawn(_exit_hard, 2, timeout_s=60)
    assert info.value.rank == 0


def _segfault_on_rank_one(rt):
    if rt.rank == 1:
        os.kill(os.getpid(), signal.SIGSEGV)  # as a crash in native code would
    dist.barrier()


def test_a_rank_killed_by_a_signal_is_named_with_where_it_was():
    with pytest.raises(SpawnError, match="signal 11") as info:
        spawn(_segfault_on_rank_one, 2, timeout_s=60)
    assert info.value.rank == 1
    assert "_segfault_on_rank_one" in str(info.value)  # the dead rank's stack, as its faulthandler wrote it


def test_spawn_rejects_empty_world():
    with pytest.raises(ValueError, match="world_size"):
        spawn(_rank_and_sum, 0, 0)


def test_free_port_is_a_usable_port():
    assert 0 < free_port() < 65536


def test_backend_choice():
    assert choose_backend("cpu", 4) == ("gloo", "cpu")
    if torch.cuda.device_count() < 4:
        assert choose_backend("auto", 4) == ("gloo", "cpu")
        with pytest.raises(ValueError, match="one GPU per rank"):
            choose_backend("cuda", 4)
    with pytest.raises(ValueError, match="device must be one of"):
        choose_backend("tpu", 1)


def test_gpu_backend_serves_cpu_tensors_too():
    # On GPUs the group is nccl for CUDA tensors and gloo for CPU ones, chosen without a GPU here.
    assert GPU_BACKEND == "cpu:gloo,cuda:nccl"
    assert choose_backend("auto", 2, gpus=2) == (GPU_BACKEND, "cuda")
    assert choose_backend("cuda", 2, gpus=8) == (GPU_BACKEND, "cuda")
    assert choose_backend("auto", 4, gpus=2) == ("gloo", "cpu")
    with pytest.raises(ValueError, match="--device cuda needs one GPU per rank: 4 ranks on this node, 2 GPUs"):
        choose_backend("cuda", 4, gpus=2)


def _rank0_works_alone(rt, work_s: float, limit_s: float):
    from distlab.processes.runtime import rank0_alone

    try:
        with rank0_alone(rt, "part 1", limit_s) as mine:
            if mine:
                time.sleep(work_s)
        dist.all_reduce(torch.ones(1))  # the process group still works afterwards
        return "ok"
    except RuntimeError as err:
        return str(err)


def test_ranks_wait_for_a_phase_rank0_runs_alone_past_the_groups_timeout_but_not_past_its_own():
    # The process group's timeout is 2 s; rank 0 works 4 s alone: a barrier of the group would end the others.
    assert spawn(_rank0_works_alone, 2, 4.0, 30.0, timeout_s=2) == ["ok", "ok"]
    late = spawn(_rank0_works_alone, 2, 6.0, 1.0, timeout_s=30)[1]  # the phase's own limit is 1 s: rank 1 says so
    assert late.startswith("rank 1 waited 1 s for rank 0's part 1") and "DISTLAB_SOLO_TIMEOUT_S" in late, late
