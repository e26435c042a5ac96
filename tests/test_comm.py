"""The ground floor of communication (distlab.comm), against torch's collectives and one process.

On P = 1, 2, 3, 4 ranks (spawn, gloo, float64): every collective by hand (`Ring`) equals the same
computation in one process and torch's collective, and sends exactly its ring formula's bytes; the
all-to-all by hand equals `dist.all_to_all_single` with uneven parts (some empty); a ledger fed torch's
collectives (`record`) counts what the rings by hand sent for the same calls. The one exchange
(`post`, waited on through `Posted`) works over a subgroup, whose ranks it maps to global ranks, and
on one rank. Each check is shown able to fail: a collective that did nothing is rejected, and the
exchange without the rank mapping is refused.
"""

from fractions import Fraction

import pytest
import torch
import torch.distributed as dist
from helpers import assert_same_error_on_every_rank

from distlab.comm.collectives import (
    COLLECTIVES,
    all_to_all_bytes,
    check_collective,
    full_numel,
    rank_input,
    ring_bytes,
    ring_fraction,
)
from distlab.comm.ledger import Ledger
from distlab.comm.p2p import Posted, post
from distlab.comm.ring import RING_RUNS, Ring
from distlab.processes.spawn import SpawnError, spawn

WORLDS = (1, 2, 3, 4)
TOL = dict(rtol=1e-10, atol=1e-12)  # float64


def test_ring_fractions_are_exact():
    assert [ring_fraction(c.name, 4) for c in COLLECTIVES] == [
        Fraction(3, 2),
        Fraction(3, 4),
        Fraction(3, 4),
        Fraction(1),
        Fraction(3, 4),
    ]
    assert ring_fraction("broadcast", 4, rank=3) == 0  # the chain's last rank forwards nothing
    assert ring_bytes("all_reduce", 12, 8, 3) == 2 * 2 * 4 * 8  # 2 (P-1) chunks of 4 elements
    assert all(ring_bytes(c.name, 12, 8, 1) == 0 for c in COLLECTIVES)  # one rank sends nothing
    assert all_to_all_bytes([3, 0, 5], row_bytes=16, rank=2) == 3 * 16


def test_a_tensor_that_does_not_cut_evenly_has_no_ring_formula():
    with pytest.raises(ValueError, match="10 elements do not cut evenly"):
        ring_bytes("reduce_scatter", 10, 8, 4)
    with pytest.raises(ValueError, match="unknown collective 'all_reduce_sum'"):
        ring_fraction("all_reduce_sum", 2)


def test_a_ledger_counts_whole_bytes_by_phase_and_kind():
    ledger = Ledger()
    ledger.add("forward", "all_reduce", 96)
    ledger.add("forward", "all_reduce", 96)
    ledger.count_sends([torch.zeros(3, dtype=torch.float64), torch.zeros(2, dtype=torch.bfloat16)], "backward")
    assert ledger.sent == 192 + 24 + 4 and ledger.sent_in("forward") == 192
    assert ledger.sent_by["backward", "send"] == 28 and ledger.calls["forward", "all_reduce"] == 2
    with pytest.raises(ValueError, match="whole bytes"):
        ledger.add("forward", "all_gather", Fraction(1, 2))
    ledger.clear()
    assert ledger.sent == 0 and not ledger.calls


def test_the_one_waiter_returns_what_arrived_once_done():
    arrived = [torch.ones(2)]
    delivered = Posted(lambda: arrived)  # an emulation's delivery: called once, on the first wait
    assert delivered.wait() is arrived and delivered.wait() is arrived
    assert Posted(arrived).wait() is arrived


def _uneven_counts(p: int) -> list[list[int]]:
    """counts[q][t]: rows rank q sends rank t, the same table on every rank (zeros included)."""
    gen = torch.Generator().manual_seed(11)
    return torch.randint(0, 4, (p, p), generator=gen).tolist()


def _by_hand(rt):
    """Every collective by hand and by torch on this rank, and the uneven all-to-all."""
    out = {}
    n = full_numel(8 * 24, rt.world_size, torch.float64)  # 24 elements: every P up to 4 divides it
    for c in COLLECTIVES:
        got, expected = check_collective(c, rt, n, 3, torch.float64)
        ring = Ring()
        mine = rank_input(c, n, rt.rank, rt, 3, torch.float64)
        recorded = Ledger()
        recorded.record("", c.name, mine if c.name != "all_gather" else got, None)
        by_hand = RING_RUNS[c](ring, mine)
        out[c.name] = (got.cpu(), by_hand.cpu(), expected, ring.ledger.sent, recorded.sent, n, mine.cpu())
    counts = _uneven_counts(rt.world_size)
    send = [counts[rt.rank][q] for q in range(rt.world_size)]
    receive = [counts[q][rt.rank] for q in range(rt.world_size)]
    x = torch.arange(sum(send) * 3, dtype=torch.float64, device=rt.device).reshape(-1, 3) + 100 * rt.rank
    theirs = x.new_empty((sum(receive), 3))
    dist.all_to_all_single(theirs, x, receive, send)
    ring = Ring()
    out["uneven"] = (ring.all_to_all(x, send, receive).cpu(), theirs.cpu(), ring.ledger.sent, send)
    return out


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a, b, **TOL)


@pytest.fixture(scope="module")
def by_hand():
    return {p: spawn(_by_hand, p) for p in WORLDS}


@pytest.mark.parametrize("world", WORLDS)
def test_every_collective_by_hand_equals_one_process_and_torch(by_hand, world):
    for rank, out in enumerate(by_hand[world]):
        for c in COLLECTIVES:
            got, mine, expected = out[c.name][:3]
            assert _close(got, expected) and _close(mine, expected), (c.name, rank)
            # The check can fail: a collective that did nothing (the rank's own input) is rejected.
            if world > 1 and (c.name, rank) != ("broadcast", 0):
                assert not _close(out[c.name][6], expected), (c.name, rank)


@pytest.mark.parametrize("world", WORLDS)
def test_every_ring_sends_its_formula_and_a_ledger_of_torchs_calls_agrees(by_hand, world):
    for rank, out in enumerate(by_hand[world]):
        for c in COLLECTIVES:
            sent, recorded, n = out[c.name][3:6]
            assert sent == recorded == ring_bytes(c.name, n, 8, world, rank), (c.name, rank, sent, recorded)
        assert world == 1 or out["all_reduce"][3] > 0


@pytest.mark.parametrize("world", WORLDS)
def test_all_to_all_by_hand_equals_torchs_with_uneven_parts(by_hand, world):
    for rank, out in enumerate(by_hand[world]):
        mine, theirs, sent, send = out["uneven"]
        assert torch.equal(mine, theirs), rank
        assert sent == all_to_all_bytes(send, 3 * 8, rank)
    assert world < 3 or any(0 in row for row in _uneven_counts(world))  # empty parts are exercised


def _shift_in_subgroups(rt, map_ranks: bool):
    """P = 4 as two rings, ranks {0, 2} and {1, 3}: each shifts its global rank to its group's right
    neighbour; and sends its group's left neighbour a message by explicit `post`."""
    import distlab.comm.p2p as p2p

    if not map_ranks:  # the wrong answer: a group rank taken for a global one
        p2p._global = lambda group, peer: peer
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]  # every rank makes every group
    group = groups[rt.rank % 2]
    ring = Ring(group)
    (left_rank,) = ring.shift(torch.tensor([float(rt.rank)])).wait()
    back = torch.empty(1)
    post([(torch.tensor([10.0 * rt.rank]), ring.left)], [(back, ring.right)], group, ring.ledger).wait()
    return left_rank.item(), back.item(), ring.ledger.sent


def test_the_exchange_works_over_a_subgroup_and_maps_its_ranks():
    got = spawn(_shift_in_subgroups, 4, True)
    assert [(left, back) for left, back, _ in got] == [(2.0, 20.0), (3.0, 30.0), (0.0, 0.0), (1.0, 10.0)]
    assert [sent for _, _, sent in got] == [8] * 4  # two float32 messages, 4 bytes each
    with pytest.raises(SpawnError, match="is not part of group"):
        spawn(_shift_in_subgroups, 4, False)


def _alone(rt):
    ring, x = Ring(), torch.arange(3.0)
    (same,) = ring.shift(x).wait()
    copied = torch.empty(3)
    post([(x * 2, 0)], [(copied, 0)], ledger=ring.ledger).wait()  # a message to oneself
    return same is x, copied.tolist(), ring.ledger.sent


def test_one_rank_is_its_own_neighbour_and_sends_nothing():
    assert spawn(_alone, 1) == [(True, [0.0, 2.0, 4.0], 0)]


def _bad_peer(rt):
    post([(torch.zeros(1), rt.world_size)], [])


def test_a_peer_outside_the_group_is_refused_before_any_message():
    assert_same_error_on_every_rank(_bad_peer, 2, match="peer 2 is not a rank of a group of 2")
