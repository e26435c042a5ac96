"""distlab.layer_split.context_parallel in one process: the splits cover the sequence once and count the work the
formulas say; attention folded one key/value tile at a time, in any order, equals torch's
scaled_dot_product_attention (out, lse and, from the tiles' backward, dq, dk, dv); and the online fold
it shares with the streamed contrastive step still computes a log-sum-exp."""

import math
import random

import pytest
import torch
import torch.nn.functional as F

from distlab.layer_split.context_parallel import split as layouts
from distlab.layer_split.context_parallel.attention import Partial, Saved, causal_mask, fold_tile, tile_grads
from distlab.pieces.online_softmax import online_fold, rescale


@pytest.mark.parametrize("split", layouts.SPLITS)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_shards_cover_the_sequence_once_and_unshard_inverts_them(split, world):
    x = torch.arange(2 * 24 * 3, dtype=torch.float64).reshape(2, 24, 3)
    positions = sorted(i for r in range(world) for piece in layouts.pieces_of(r, world, 24, split) for i in piece)
    assert positions == list(range(24))
    assert torch.equal(layouts.unshard([layouts.shard(x, r, world, split) for r in range(world)], split), x)


def test_zigzag_pairs_an_early_piece_with_a_late_one():
    assert [[p.start // 3 for p in layouts.pieces_of(r, 4, 24, "zigzag")] for r in range(4)] == [
        [0, 7],
        [1, 6],
        [2, 5],
        [3, 4],
    ]


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 8])
def test_counted_work_equals_the_formula(world):
    seq = 2 * world * 5
    for split in layouts.SPLITS:
        for causal in (True, False):
            work = [layouts.count_work(r, world, seq, split, causal) for r in range(world)]
            assert [w.products for w in work] == [
                layouts.work_formula(r, world, seq, split, causal) for r in range(world)
            ]
    zigzag = [layouts.count_work(r, world, seq, "zigzag", True) for r in range(world)]
    contiguous = [layouts.count_work(r, world, seq, "contiguous", True).products for r in range(world)]
    assert all((w.full, w.diagonal) == (2 * world - 1, 2) for w in zigzag)
    assert contiguous == [(r + 1) * contiguous[0] for r in range(world)]


def test_a_length_the_split_cannot_cut_names_the_flag():
    for seq, world, split, what in ((18, 4, "zigzag", "2P = 8"), (10, 3, "contiguous", "P = 3")):
        with pytest.raises(ValueError, match="--seq-len") as err:
            layouts.check_seq_len(seq, world, split)
        assert what in str(err.value)
    layouts.check_seq_len(24, 4, "zigzag")


def _qkv(seq=12, gen_seed=3):
    gen = torch.Generator().manual_seed(gen_seed)
    return [torch.randn(2, seq, 4, generator=gen, dtype=torch.float64) * 3 for _ in range(4)]


@pytest.mark.parametrize("causal", [True, False])
def test_tiles_folded_in_any_order_equal_sdpa(causal):
    q, k, v, dout = _qkv()
    pieces = [range(0, 4), range(4, 8), range(8, 12)]
    out, lse = torch.empty_like(q), q.new_empty(q.shape[:-1])
    for rows in pieces:
        part = Partial.start(out[..., rows.start : rows.stop, :])
        keys = [p for p in pieces if layouts.tile_kind(rows, p, causal) != layouts.SKIP]
        random.Random(rows.start).shuffle(keys)  # the fold does not care about the order
        for cols in keys:
            mask = (
                causal_mask(rows, cols, q.device) if layouts.tile_kind(rows, cols, causal) == layouts.DIAGONAL else None
            )
            fold_tile(
                part,
                q[..., rows.start : rows.stop, :],
                k[..., cols.start : cols.stop, :],
                v[..., cols.start : cols.stop, :],
                mask,
            )
        part.finish(lse[..., rows.start : rows.stop])
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*leaves, is_causal=causal)
    scores = q @ k.transpose(-1, -2) / math.sqrt(4)
    if causal:
        scores = scores.masked_fill(torch.ones(12, 12, dtype=torch.bool).triu(1), float("-inf"))
    assert torch.allclose(out, ref, rtol=1e-10, atol=1e-12)
    assert torch.allclose(lse, scores.logsumexp(-1), rtol=1e-10, atol=1e-12)

    ref.backward(dout)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    delta = (dout * out).sum(-1)
    for rows in pieces:
        r = slice(rows.start, rows.stop)
        saved = Saved(q[..., r, :], dout[..., r, :], lse[..., r], delta[..., r])
        for cols in pieces:
            kind = layouts.tile_kind(rows, cols, causal)
            if kind == layouts.SKIP:
                continue
            c = slice(cols.start, cols.stop)
            mask = causal_mask(rows, cols, q.device) if kind == layouts.DIAGONAL else None
            d_q, d_k, d_v = tile_grads(saved, k[..., c, :], v[..., c, :], mask)
            dq[..., r, :] += d_q
            dk[..., c, :] += d_k
            dv[..., c, :] += d_v
    for got, leaf in zip((dq, dk, dv), leaves):
        assert torch.allclose(got, leaf.grad, rtol=1e-10, atol=1e-12)


def test_the_online_fold_still_computes_a_log_sum_exp_and_leaves_the_weights():
    x = torch.randn(5, 30, dtype=torch.float64) * 50  # large logits: nothing may overflow
    run_max, run_sum = torch.full((5,), float("-inf"), dtype=torch.float64), torch.zeros(5, dtype=torch.float64)
    for cols in (slice(0, 7), slice(7, 20), slice(20, 30)):
        tile = x[:, cols].clone()
        run_max, run_sum = online_fold(run_max, run_sum, tile, dim=1)
        assert torch.allclose(tile, (x[:, cols] - run_max.unsqueeze(1)).exp())
    assert torch.allclose(run_max + run_sum.log(), x.logsumexp(1), rtol=1e-12, atol=0)
    assert torch.equal(rescale(torch.tensor(float("-inf")), torch.tensor(2.0)), torch.tensor(0.0))


def test_the_cost_formulas_in_blocks():
    from distlab.layer_split.context_parallel.cost import Sizes

    sizes = Sizes(heads=2, seq_len=48, head_dim=16, world_size=4, itemsize=8)
    assert (sizes.block, sizes.tile, sizes.row) == (2 * 12 * 16 * 8, 2 * 6 * 6 * 8, 2 * 12 * 8)
    assert sizes.expected_bytes() == (6 * sizes.block, 14 * sizes.block)
    assert Sizes(2, 48, 16, 1, 8).expected_bytes() == (0, 0)
