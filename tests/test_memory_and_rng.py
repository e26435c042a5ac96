"""The two measuring/replaying tools later lessons rely on."""

import gc

import torch
from torch import nn

from distlab.pieces.random_state import RandContext
from distlab.proof.memory import MIB, PeakMemory


def test_peak_memory_counts_live_storage_and_releases_it():
    with PeakMemory() as mem:
        a = torch.zeros(MIB // 4)  # 1 MiB of float32
        b = torch.zeros(MIB // 2)  # 2 MiB: 3 MiB live together
        del a
        c = b.view(-1)[:10]  # a view allocates nothing
        del b, c
        d = torch.zeros(MIB // 4)
    gc.collect()
    assert mem.peak_bytes == 3 * MIB
    assert mem.largest_bytes == 2 * MIB
    assert mem.live_bytes == MIB  # only d is still alive
    del d
    assert mem.live_bytes == 0


def test_peak_memory_ignores_what_existed_before():
    big = torch.zeros(MIB)
    with PeakMemory() as mem:
        small = big[:10] + 1
    assert mem.peak_bytes == small.untyped_storage().nbytes()


def test_rand_context_replays_dropout_and_leaves_the_outer_stream_alone():
    drop = nn.Dropout(0.5)
    x = torch.ones(1000)
    torch.manual_seed(0)
    state = RandContext(x)
    first = drop(x)
    after_first = torch.rand(3)
    torch.manual_seed(0)
    torch.rand(1000)  # move the stream somewhere else entirely
    before = torch.get_rng_state()
    with state:
        again = drop(x)
    assert torch.equal(first, again)
    assert torch.equal(torch.get_rng_state(), before)
    assert not torch.equal(first, drop(x))  # without the context the masks differ
    assert after_first.shape == (3,)


def test_rand_context_saves_the_generator_of_the_models_device_too():
    """A model on cuda:0 that moves CPU batches to the GPU inside forward draws its dropout masks from
    cuda:0's generator: the batch alone names no GPU, the model does. (Fake CUDA tensors: no GPU here.)"""
    from torch._subclasses.fake_tensor import FakeTensorMode

    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1))
    batch = {"x": torch.ones(2, 4), "y": [torch.ones(2, 4)]}
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device="cuda")
        on_gpu = torch.empty(3, device="cuda")
    assert RandContext.cuda_devices(batch) == []
    assert RandContext.cuda_devices(model, batch) == [0]
    assert RandContext.cuda_devices(batch, [on_gpu, on_gpu]) == [0]  # each device once


def test_peak_memory_on_cuda_reads_the_allocators_peak_beside_its_own(monkeypatch):
    """On a GPU, torch.cuda.max_memory_allocated over the block (above what was there before) beside the
    dispatch count; the CUDA calls are faked here (no GPU), in the order a GPU would see them."""
    calls, allocated = [], {"now": 1000, "peak": 1000}
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append("sync"))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: allocated["now"])
    monkeypatch.setattr(
        torch.cuda, "reset_peak_memory_stats", lambda device=None: allocated.update(peak=allocated["now"])
    )
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: allocated["peak"])
    with PeakMemory(torch.device("cuda", 0)) as mem:
        x = torch.zeros(MIB // 4)  # (a CPU tensor: what the dispatch count sees)
        allocated["peak"] = 1000 + 2 * MIB  # what the GPU's allocator would have seen meanwhile
    assert mem.peak_bytes == x.untyped_storage().nbytes() and mem.allocator_peak_bytes == 2 * MIB
    assert calls == ["sync", "sync"]
    with PeakMemory(torch.device("cpu")) as cpu:
        pass
    assert cpu.allocator_peak_bytes is None and calls == ["sync", "sync"]
