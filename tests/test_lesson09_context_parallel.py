"""Lesson 09: ring attention, forward and backward, equals torch's scaled_dot_product_attention on the
whole sequence in one process (float64, out, dq, dk, dv to 1e-10), causal and not, zig-zag and
contiguous, at P = 1, 2, 3, 4; every rank sends exactly the formula's bytes; the zig-zag split
balances causal work and the contiguous one does not; a bad sequence length is one line naming the
flag on every rank; and ring attention folds with the very function the streamed contrastive step
uses."""

import pytest
import torch
import torch.nn.functional as F
from helpers import (
    assert_flag_refused,
    assert_lesson_passes_at_80_columns,
    assert_same_error_on_every_rank,
    load_lesson,
    torchrun,
)

from distlab.layer_split.context_parallel.split import Layout, check_seq_len, shard, unshard
from distlab.processes.spawn import spawn

HEADS, SEQ, HEAD_DIM = 2, 24, 4  # 24 = 2P x 3 at P = 4, 2P x 4 at P = 3
SPAWNED = (1, 2, 3, 4)  # every P, with the lesson's own RingAttention (spawn: ranks forked in milliseconds)
LAUNCHED = (3, 4)  # the whole lesson under torchrun (its verdict, 80 columns): an odd and an even P
CASES = [("zigzag", True), ("zigzag", False), ("contiguous", True), ("contiguous", False)]


def _inputs():
    gen = torch.Generator().manual_seed(7)
    return [torch.randn(HEADS, SEQ, HEAD_DIM, generator=gen, dtype=torch.float64) * 2 for _ in range(4)]


def _ring(rt):
    """Every case on this rank with the lesson's own RingAttention: (local results, bytes sent)."""
    from collections import Counter

    from distlab.comm.ring import Ring

    lesson = load_lesson("context_parallel")
    out = {}
    for split, causal in CASES:
        q, k, v, dout = (shard(t, rt.rank, rt.world_size, split) for t in _inputs())
        for t in (q, k, v):
            t.requires_grad_()
        ring = Ring()
        o = lesson.RingAttention.apply(q, k, v, ring, Layout(rt.world_size, SEQ, split, causal), Counter())
        forward_bytes = ring.ledger.sent
        o.backward(dout)
        out[(split, causal)] = ([o.detach(), q.grad, k.grad, v.grad], (forward_bytes, ring.ledger.sent - forward_bytes))
    return out


@pytest.fixture(scope="module")
def runs():
    return {p: spawn(_ring, p) for p in SPAWNED}


def _sdpa(causal):
    """One process, the whole sequence, plain autograd: the independent reference."""
    q, k, v, dout = _inputs()
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    out.backward(dout)
    return [out.detach(), q.grad, k.grad, v.grad]


@pytest.mark.parametrize("world", SPAWNED)
@pytest.mark.parametrize("split,causal", CASES)
def test_ring_attention_equals_sdpa_on_the_whole_sequence(runs, world, split, causal):
    ranks = runs[world]
    for name, ref, i in zip(("out", "dq", "dk", "dv"), _sdpa(causal), range(4)):
        got = unshard([r[(split, causal)][0][i] for r in ranks], split)
        assert torch.allclose(got, ref, rtol=1e-10, atol=1e-12), (name, (got - ref).abs().max())


@pytest.mark.parametrize("world", SPAWNED)
def test_bytes_per_rank_equal_the_formula(runs, world):
    """A block is h (seq/P) d_h float64 values; forward 2(P-1) blocks (k, v), backward 2(P-1)
    (k, v again) + 2P (dk, dv, home after P moves); at P = 1 nothing moves."""
    block = HEADS * (SEQ // world) * HEAD_DIM * 8
    expected = (2 * (world - 1) * block, (4 * world - 2) * block if world > 1 else 0)
    for rank in runs[world]:
        assert all(sent == expected for _, sent in rank.values()), (world, expected, rank)


def test_ring_attention_and_the_streamed_step_import_the_same_fold():
    from distlab.layer_split.context_parallel import attention
    from distlab.pieces import online_softmax
    from distlab.streamed import torch_tiles as streamed_tiles

    assert attention.online_fold is online_softmax.online_fold
    assert streamed_tiles.online_fold is online_softmax.online_fold


def _check(rt, seq_len, split):
    check_seq_len(seq_len, rt.world_size, split)


def test_a_sequence_length_the_split_cannot_cut_is_refused_on_every_rank():
    message = assert_same_error_on_every_rank(_check, 2, 18, "zigzag", match="--seq-len")
    assert "2P = 4" in message and "\n" not in message  # (the contiguous split's message: test_context_parallel)
    assert_flag_refused("context_parallel", "--seq-len", "--seq-len", "0")


def test_the_lesson_refuses_a_bad_length_before_any_collective():
    run = torchrun("context_parallel", 2, "--seq-len", "6", columns=80)
    lines = [line for line in run.stdout.splitlines() if "--seq-len" in line]
    assert run.returncode != 0 and len(lines) == 1 and "2P = 4" in lines[0], run.stdout + run.stderr


# P = 1 and 2 under torchrun cost 5 s each of start-up and checked what the spawned runs above check at
# every P (equal to SDPA, bytes = formula); the tables are widest at P = 4 (a column per rank).
@pytest.mark.parametrize("world", LAUNCHED)
def test_the_lesson_passes(world):
    out = assert_lesson_passes_at_80_columns("context_parallel", world)
    assert "zigzag, causal: P" in out and "4P-2 backward" in out


def test_the_bound_beats_the_whole_sequence_only_from_some_p():
    """Section 5's sentence: at the lesson's defaults (seq 48, h 2, d_h 16, float64) a rank at P = 2 may hold
    more than the whole sequence's k and v; the forward's bound is below it from P = 4, the backward's from 6."""
    from distlab.layer_split.context_parallel.cost import Sizes, beats_whole

    sizes = Sizes(heads=2, seq_len=48, head_dim=16, world_size=2, itemsize=8)
    worlds = [2, 3, 4, 6, 8, 12]
    assert sizes.whole_kv() == 24_576 == sizes.at(6).whole_kv()  # the same bytes at every P
    assert min(sizes.memory_bound()) > sizes.whole_kv()
    assert beats_whole(sizes, worlds) == (4, 6)
    assert beats_whole(sizes, [8, 12]) == (8, 8)  # every P of the list below: the first one
    assert beats_whole(sizes, [2, 3]) == (None, None)  # none below: none named
