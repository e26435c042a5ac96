"""Lesson 16: activation offloading by hand (saved-tensor hooks into a host pool, a copy thread, one group
prefetched ahead) gives gradients bit for bit equal to no offloading and to torch's save_on_cpu, with and
without prefetch, at several sizes; it moves exactly lesson 07's activation bytes each way; its device peak of
saved activations equals max (H_k + H_(k-1)) with prefetch and max H_k without; only the first group is
fetched on demand with prefetch; the checks fail on a pool keyed by addresses (a reused address hands
backward another tensor), on a pool that copies a tensor saved twice twice, and on one that never frees."""

import argparse
import weakref

import pytest
import torch
from helpers import assert_flag_refused, assert_lesson_passes_at_80_columns, load_lesson

from distlab.data_split.sharding.accounting import mlp_activations


def _args(**changes) -> argparse.Namespace:
    args = dict(width=24, layers=3, global_batch=16, seed=1, emulate_ms=0.0, link_ms_per_mib=0.0)
    return argparse.Namespace(**{**args, **changes})


SIZES = [dict(), dict(width=40, layers=5, global_batch=12), dict(width=8, layers=1, global_batch=5)]


@pytest.fixture(scope="module", params=range(len(SIZES)), ids=["small", "deeper", "one hidden layer"])
def runs(request):
    lesson, args = load_lesson("activation_offloading"), _args(**SIZES[request.param])
    return args, {how: lesson.step(args, how) for how in ("plain", "save_on_cpu", "serialised", "offload")}


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a["grads"], b["grads"]))


@pytest.mark.parametrize("how", ["offload", "serialised"])
def test_gradients_bit_for_bit(runs, how):
    _, run = runs
    assert _same(run[how], run["plain"]) and _same(run[how], run["save_on_cpu"])


def test_bytes_each_way_equal_lesson_07s_formula(runs):
    args, run = runs
    formula = mlp_activations(args.global_batch, run["plain"]["widths"], 8)
    for how in ("offload", "serialised"):
        off = run[how]["offloader"]
        assert off.sent == off.received == formula
    assert run["plain"]["held"] == formula  # what plain autograd keeps, counted by storage


def test_device_peaks_equal_their_formulas(runs):
    args, run = runs
    groups = load_lesson("activation_offloading").group_bytes(run["plain"]["widths"], args.global_batch, 8)
    assert sum(groups) == mlp_activations(args.global_batch, run["plain"]["widths"], 8)
    assert run["offload"]["offloader"].peak == max(a + b for a, b in zip(groups, groups[1:]))
    assert run["serialised"]["offloader"].peak == max(groups)
    assert run["offload"]["offloader"].device_bytes == 0  # every device copy released after backward
    assert run["offload"]["offloader"].on_demand == 1
    assert run["serialised"]["offloader"].on_demand == len(groups)


# ---- wrong pools: the lesson's, one piece wrong ------------------------------------------------------------


def _keyed_by_address(offloader_class):
    """A pool that dedups by address alone, never forgetting one: a dead tensor's address, reused by a new
    one, hands backward the dead tensor's values (torchtitan PR 2581's silent corruption)."""

    class ByAddress(offloader_class):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.alive = _NeverForgets()

    return ByAddress


class _NeverForgets(dict):
    def pop(self, key, default=None):  # the finalizer's "forget this address" does nothing
        return self.get(key, default)


def _copies_twice(offloader_class):
    class Twice(offloader_class):
        def pack(self, t):
            self.alive.clear()  # no dedup: the tanh output the next Linear saves again travels again
            return super().pack(t)

    return Twice


def _with(monkeypatch, wrap, args, how="offload"):
    lesson = load_lesson("activation_offloading")
    monkeypatch.setattr(lesson, "Offloader", wrap(lesson.Offloader))
    return lesson.step(args, how)


class _CachingAllocator:
    """Addresses as a caching allocator (CUDA's) hands them out: a storage that dies returns its address to a
    free list of its size, and the next new storage of that size gets it back. Installed as the storages'
    `data_ptr`, so the lesson's pool sees reused addresses every time, not only when the host's allocator
    happens to reuse one."""

    def __init__(self):
        self.real = torch.UntypedStorage.data_ptr
        self.address: dict[int, int] = {}  # real address of a live storage -> the address it is shown
        self.free: dict[int, list[int]] = {}  # nbytes -> addresses given back, the newest last
        self.next, self.reused = 1 << 40, 0

    def address_of(self, storage) -> int:
        real = self.real(storage)
        if real not in self.address:
            nbytes = storage.nbytes()
            if self.free.get(nbytes):
                self.address[real], self.reused = self.free[nbytes].pop(), self.reused + 1
            else:
                self.address[real], self.next = self.next, self.next + nbytes
            weakref.finalize(storage, self._give_back, real, nbytes)
        return self.address[real]

    def _give_back(self, real: int, nbytes: int) -> None:
        self.free.setdefault(nbytes, []).append(self.address.pop(real))


def test_the_gradient_check_fails_on_a_pool_keyed_by_addresses(monkeypatch):
    """Under an allocator that reuses a dead tensor's address (as CUDA's caching allocator does, every step),
    the lesson's pool, which forgets an address when its storage dies, stays exact; a pool that never forgets
    hands backward a dead tensor's values (torchtitan PR 2581's silent corruption): the gradients differ."""
    lesson, args = load_lesson("activation_offloading"), _args(layers=4)
    plain = lesson.step(args, "plain")
    allocator, own = _CachingAllocator(), lesson.Offloader
    monkeypatch.setattr(torch.UntypedStorage, "data_ptr", lambda storage: allocator.address_of(storage))
    for how in ("offload", "serialised"):
        assert _same(lesson.step(args, how), plain)
        assert not _same(_with(monkeypatch, _keyed_by_address, args, how), plain)
        monkeypatch.setattr(lesson, "Offloader", own)
    assert allocator.reused > 0  # the right pool was exact with addresses coming back, not without them


def test_the_byte_check_fails_on_a_pool_that_copies_twice(monkeypatch):
    args = _args()
    wrong = _with(monkeypatch, _copies_twice, args)
    assert _same(wrong, load_lesson("activation_offloading").step(args, "plain"))  # right numbers ...
    assert wrong["offloader"].sent > mlp_activations(args.global_batch, wrong["widths"], 8)  # ... more bytes


def test_parameters_are_never_moved():
    lesson, args = load_lesson("activation_offloading"), _args()
    run = lesson.step(args, "offload")
    moved = run["offloader"].sent
    assert moved == mlp_activations(args.global_batch, run["widths"], 8)  # no weight among them
    assert run["params"] == sum(p.numel() * 8 for p in lesson.make_problem(args)[0].parameters())


def test_bad_flags_are_refused():
    assert_flag_refused("activation_offloading", "--width", "--width", "0")
    assert_flag_refused("activation_offloading", "--link-ms-per-mib", "--link-ms-per-mib", "-1")


def test_the_lesson_passes():
    out = assert_lesson_passes_at_80_columns(
        "activation_offloading", 1, "--width", "64", "--global-batch", "64", "--emulate-ms", "2"
    )
    assert "bit for bit" in out and "peak, prefetch" in out and "recompute" in out
