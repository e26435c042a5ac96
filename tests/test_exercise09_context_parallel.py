"""Exercise 09: ring attention's forward, judged on 3 ranks against torch's scaled_dot_product_attention
on the whole sequence in one process.

Each rank takes its zig-zag share of q, k, v and calls the answer, causal and not. The lesson's claims:
this rank's out and lse equal one process's (float64, rtol 1e-10); the k/v blocks went round the ring
(2(P-1) blocks sent); and the causal tiles after the diagonal were skipped (the products computed equal
the layout's count, the same on every rank)."""

from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F
from exercise_kit import Answer, exercise_tests, judge

from distlab.comm.ring import Ring
from distlab.context_parallel.attention import Partial, causal_mask, scores
from distlab.context_parallel.split import SKIP, Layout, count_work, shard, tile_kind

LESSON, NAME = "09_context_parallel", "ring_forward"
P, HEADS, SEQ, HEAD_DIM = 3, 2, 18, 4


def _max_rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-300)).item()


def _reference(q, k, v, causal):
    """One process, the whole sequence: out by SDPA, lse as the rows' log-sum-exp of the scores."""
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    a = q @ k.transpose(-1, -2) / HEAD_DIM**0.5
    if causal:
        a = a.masked_fill(torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1), float("-inf"))
    return out, a.logsumexp(-1)


def _ranks(rt, ring_forward, claims) -> None:
    gen = torch.Generator().manual_seed(4)
    full = [torch.randn(HEADS, SEQ, HEAD_DIM, generator=gen, dtype=torch.float64) * 2 for _ in range(3)]
    block = HEADS * (SEQ // P) * HEAD_DIM * 8
    for causal in (False, True):  # every rank runs every case: none may leave the ring early
        name = "causal" if causal else "not causal"
        layout = Layout(P, SEQ, "zigzag", causal)
        ring, tally = Ring(), Counter()
        out, lse = ring_forward(ring, *(shard(t, rt.rank, P, "zigzag") for t in full), layout, tally)
        ref_out, ref_lse = _reference(*full, causal)
        err = _max_rel(out, shard(ref_out, rt.rank, P, "zigzag"))
        claims.check(
            f"{name}: out equals SDPA's on the whole sequence",
            err < 1e-10,
            f"largest relative difference {err:.2e}",
            "rescale o by exp(m - m') whenever the max grows, and divide by l at the end",
        )
        err = _max_rel(lse, shard(ref_lse.unsqueeze(-1), rt.rank, P, "zigzag").squeeze(-1))
        claims.check(
            f"{name}: lse equals the rows' log-sum-exp",
            err < 1e-10,
            f"largest relative difference {err:.2e}",
            "lse = m + log l, after the last block",
        )
        claims.check(
            f"{name}: the k/v blocks went round the ring, 2(P-1) blocks sent",
            ring.ledger.sent == 2 * (P - 1) * block,
            f"{ring.ledger.sent} bytes, not {2 * (P - 1) * block}",
            "shift (k, v) to the right neighbour P - 1 times, keep what arrives",
        )
        want = count_work(rt.rank, P, SEQ, "zigzag", causal).products
        claims.check(
            f"{name}: the tiles after the diagonal were skipped",
            tally["products"] == want,
            f"{tally['products']} products counted, the layout computes {want}",
            "skip a tile when tile_kind says skip; count rows x columns of every tile you fold",
        )


def check(answer: Answer) -> None:
    judge(_ranks, P, answer)


def no_rescale(ring, q, k, v, layout, tally):
    """A wrong answer: o accumulated without rescaling it by exp(m - m') when the max grows."""
    out, lse = torch.empty_like(q), q.new_empty(q.shape[:-1])
    mine, kv = layout.pieces(ring.rank), (k, v)
    parts = [Partial.start(out[..., rows, :]) for rows, _ in mine]
    for step in range(ring.world_size):
        source = (ring.rank - step) % ring.world_size
        arriving = ring.shift(*kv) if step < ring.world_size - 1 else None
        for (rows, positions), part in zip(mine, parts):
            for cols, keys in layout.pieces(source):
                kind = tile_kind(positions, keys, layout.causal)
                if kind == SKIP:
                    continue
                mask = causal_mask(positions, keys, q.device) if layout.causal else None
                tile = scores(q[..., rows, :], kv[0][..., cols, :], mask)
                new_max = torch.maximum(part.run_max, tile.amax(-1))
                weights = (tile - new_max.unsqueeze(-1)).exp()
                part.run_sum = part.run_sum * (part.run_max - new_max).exp() + weights.sum(-1)
                part.out.add_(weights @ kv[1][..., cols, :])  # the missing factor: exp(m - m')
                part.run_max = new_max
                tally[kind] += 1
                tally["products"] += len(positions) * len(keys)
        if arriving is not None:
            kv = tuple(arriving.wait())
    for (rows, _), part in zip(mine, parts):
        part.finish(lse[..., rows])
    return out, lse


test_exercise, test_the_judge_rejects_a_blank_and_a_wrong_answer = exercise_tests(
    LESSON, NAME, check, wrong=Answer(Path(__file__), "no_rescale"), wrong_claim="out equals SDPA"
)
