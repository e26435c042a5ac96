"""Lesson 11: Ulysses (all-to-all from the sequence split to the head split, SDPA on whole sequences of h/P
heads, and back) equals torch's scaled_dot_product_attention on the whole sequence in one process (float64,
out, dq, dk, dv to 1e-10), causal and not, at P = 1, 2, 3, 4; every rank sends 4 (P-1)/P blocks each way, no
more than ring attention's formula; the check fails on a wrong answer (the head split read without
reordering the positions); h or seq not divisible by P is one line naming the flag on every rank."""

import pytest
import torch
import torch.nn.functional as F
from helpers import (
    assert_flag_refused,
    assert_lesson_passes_at_80_columns,
    assert_same_error_on_every_rank,
    load_lesson,
)

from distlab.comm.differentiable import all_to_all
from distlab.comm.ledger import Ledger
from distlab.layer_split.context_parallel import ulysses
from distlab.layer_split.context_parallel.cost import Sizes
from distlab.layer_split.context_parallel.split import shard, unshard
from distlab.processes.spawn import spawn

HEADS, SEQ, HEAD_DIM = 12, 12, 3  # P = 1, 2, 3, 4 divide both


def _inputs():
    gen = torch.Generator().manual_seed(11)
    return [torch.randn(HEADS, SEQ, HEAD_DIM, generator=gen, dtype=torch.float64) for _ in range(4)]


def _unordered_seq_to_heads(x, ledger, phases, group=None):
    """The wrong answer: the arrived rows read as (h/P, seq, d_h) as they lie, by source rank first."""
    p = torch.distributed.get_world_size(group)
    heads, local, head_dim = x.shape
    parts = [heads // p] * p
    rows = all_to_all(x.reshape(heads, local * head_dim), parts, parts, group, ledger, phases)
    return rows.reshape(heads // p, p * local, head_dim)


def _ulysses(rt):
    """Every case on this rank with the lesson's ulysses_attention, and with the wrong answer in place of its
    seq_to_heads: {wrong: {causal: (local results, bytes sent)}}."""
    return {wrong: _cases(rt, wrong) for wrong in (False, True)}


def _cases(rt, wrong: bool):
    from helpers import load_lesson as load

    lesson = load("11_ulysses")
    right = lesson.seq_to_heads
    if wrong:
        lesson.seq_to_heads = _unordered_seq_to_heads
    out = {}
    try:
        for causal in (False, True):
            q, k, v, dout = (shard(t, rt.rank, rt.world_size, "contiguous") for t in _inputs())
            for t in (q, k, v):
                t.requires_grad_()
            ledger = Ledger()
            o = lesson.ulysses_attention(q, k, v, causal, ledger)
            o.backward(dout)
            out[causal] = (
                [o.detach(), q.grad, k.grad, v.grad],
                (ledger.sent_in("forward"), ledger.sent_in("backward")),
            )
    finally:
        lesson.seq_to_heads = right
    return out


@pytest.fixture(scope="module")
def runs():
    every = {p: spawn(_ulysses, p) for p in (1, 2, 3, 4)}
    return {(p, wrong): [rank[wrong] for rank in ranks] for p, ranks in every.items() for wrong in (False, True)}


def _sdpa(causal):
    q, k, v, dout = _inputs()
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    out.backward(dout)
    return [out.detach(), q.grad, k.grad, v.grad]


def _equal(ranks, causal) -> bool:
    return all(
        torch.allclose(unshard([r[causal][0][i] for r in ranks], "contiguous"), ref, rtol=1e-10, atol=1e-12)
        for i, ref in enumerate(_sdpa(causal))
    )


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("causal", [False, True])
def test_ulysses_equals_sdpa_on_the_whole_sequence(runs, world, causal):
    assert _equal(runs[world, False], causal)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_the_check_fails_on_positions_left_in_arrival_order(runs, world):
    """Without the reorder the heads and positions a rank attends over are scrambled: not SDPA's."""
    assert not _equal(runs[world, True], False) and not _equal(runs[world, True], True)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_bytes_per_rank_equal_the_formula_and_beat_the_rings(runs, world):
    block = HEADS * (SEQ // world) * HEAD_DIM * 8
    expected = (4 * (world - 1) * block // world,) * 2
    assert ulysses.expected_bytes(Sizes(HEADS, SEQ, HEAD_DIM, world, 8)) == expected
    for rank in runs[world, False]:
        assert all(sent == expected for _, sent in rank.values()), (world, expected, rank)
    ring = Sizes(HEADS, SEQ, HEAD_DIM, world, 8).expected_bytes()
    assert expected[0] <= ring[0] and expected[1] <= ring[1]
    assert (expected[0] == ring[0]) == (world in (1, 2))  # forward: equal at P = 2, less from P = 3


def _check(rt, heads, seq_len):
    ulysses.check_split(heads, seq_len, 3)


def test_heads_or_a_sequence_p_does_not_divide_are_refused_on_every_rank():
    message = assert_same_error_on_every_rank(_check, 2, 8, 12, match="--heads")
    assert "h = 8" in message and "P = 3" in message and "\n" not in message
    with pytest.raises(ValueError, match="--seq-len"):
        ulysses.check_split(12, 8, 3)
    assert_flag_refused("11_ulysses", "--heads", "--heads", "0")


def test_the_lesson_passes():
    out = assert_lesson_passes_at_80_columns("11_ulysses.py", 4)
    assert "causal: P = 4 ranks" in out and "Ulysses fwd" in out
    assert load_lesson("11_ulysses").PHASES == ("forward", "backward")
