"""The two measuring/replaying tools later lessons rely on."""

import gc

import torch
from torch import nn

from distlab.console import MIB
from distlab.memory import PeakMemory
from distlab.random_state import RandContext


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
