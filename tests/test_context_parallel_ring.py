"""The library's ring attention (`distlab.layer_split.context_parallel.ring_attention`, what lesson 12's
transformer calls) is lesson 09's ring: bit for bit the same out, dq, dk, dv, on a batch of sequences
(N, h, seq/P, d_h), for every split and causal or not; both equal scaled_dot_product_attention on the whole
sequence; and as the core of `distlab.proof.models.Attention` it turns the block's attention into the ring's."""

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from helpers import load_lesson

from distlab.comm.ring import Ring
from distlab.layer_split.context_parallel import split as layouts
from distlab.layer_split.context_parallel.ring_attention import RingAttention, ring_core
from distlab.processes.spawn import spawn
from distlab.proof.models import BlockOptions

CASES = (("zigzag", True), ("zigzag", False), ("contiguous", True))


def _inputs(seq: int):
    gen = torch.Generator().manual_seed(5)
    return [torch.randn(2, 3, seq, 4, generator=gen, dtype=torch.float64) for _ in range(4)]  # q, k, v, dout


def _ring(rt, attention, layout, inputs):
    q, k, v, dout = (layouts.shard(t, rt.rank, rt.world_size, layout.split) for t in inputs)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = attention(q, k, v, Ring(), layout)
    out.backward(dout)
    return [t.detach().clone() for t in (out, q.grad, k.grad, v.grad)]


def _both(rt, seq: int):
    """Per case: (library's results, lesson 09's results, SDPA's on the whole sequence, this rank's part)."""
    lesson = load_lesson("09_context_parallel")
    out = {}
    for split, causal in CASES:
        layout, inputs = layouts.Layout(rt.world_size, seq, split, causal), _inputs(seq)
        ours = _ring(rt, RingAttention.apply, layout, inputs)
        lessons = lambda q, k, v, ring, lay: lesson.RingAttention.apply(q, k, v, ring, lay, Counter())  # noqa: E731
        theirs = _ring(rt, lessons, layout, inputs)
        q, k, v = (t.clone().requires_grad_() for t in inputs[:3])
        whole = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        whole.backward(inputs[3])
        sdpa = [layouts.shard(t.detach(), rt.rank, rt.world_size, split) for t in (whole, q.grad, k.grad, v.grad)]
        out[split, causal] = (ours, theirs, sdpa)
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_the_librarys_ring_is_lesson_09s_bit_for_bit_and_equals_sdpa(world):
    for rank, cases in enumerate(spawn(_both, world, 12 * world)):
        for case, (ours, theirs, sdpa) in cases.items():
            assert all(torch.equal(a, b) for a, b in zip(ours, theirs)), (rank, case)
            assert all(torch.allclose(a, b, rtol=1e-10, atol=1e-12) for a, b in zip(ours, sdpa)), (rank, case)


def _as_core(rt, causal_block: bool):
    layout, inputs = layouts.Layout(rt.world_size, 8, "zigzag", True), _inputs(8)
    q, k, v, _ = (layouts.shard(t, rt.rank, rt.world_size, "zigzag") for t in inputs)
    core = ring_core(Ring(), layout)
    try:
        out = core(q, k, v, BlockOptions(causal=causal_block))
    except ValueError as err:
        return str(err)
    whole = F.scaled_dot_product_attention(*inputs[:3], is_causal=True)
    return torch.allclose(out, layouts.shard(whole, rt.rank, rt.world_size, "zigzag"), rtol=1e-10, atol=1e-12)


def test_as_the_blocks_core_it_refuses_a_block_that_disagrees_on_causality():
    assert spawn(_as_core, 2, True) == [True, True]
    assert all("causal=False" in message for message in spawn(_as_core, 2, False))


def _wrong_layout(rt):
    """Zig-zag shards, and the ring told they are contiguous: its causal masks fall in the wrong places."""
    inputs = _inputs(8)
    sharded = [layouts.shard(t, rt.rank, rt.world_size, "zigzag") for t in inputs[:3]]
    out = RingAttention.apply(*sharded, Ring(), layouts.Layout(rt.world_size, 8, "contiguous", True))
    whole = F.scaled_dot_product_attention(*inputs[:3], is_causal=True)
    return torch.allclose(out, layouts.shard(whole, rt.rank, rt.world_size, "zigzag"), rtol=1e-10, atol=1e-12)


def test_a_wrong_layout_is_caught():
    """The comparison can fail: the ring with a layout other than the shards' is not SDPA's."""
    assert spawn(_wrong_layout, 2) == [False, False]
