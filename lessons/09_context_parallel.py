"""Lesson 09: context parallelism. The sequence is split over the ranks; query blocks stay, key/value
blocks travel a ring, and every rank folds the partial attentions with the online max/sum.

    torchrun --nproc-per-node 4 lessons/09_context_parallel.py     # any P with 2P dividing --seq-len

Rank r holds seq/P positions: its queries q_r and, at first, its keys and values k_r, v_r (h heads of
width d_h). Attention out = softmax(q k^T / sqrt(d_h)) v needs every key for every query. The ring: in
P steps every rank passes the k/v block it holds to rank r+1 and receives one from r-1; in step i rank
r holds the block of rank r-i and folds the tile of scores A = q_r k_{r-i}^T / sqrt(d_h) into running
statistics per query row, max m, sum l and output o (all three under the same max):

    m' = max(m, rowmax A),  l' = l e^(m - m') + rowsum e^(A - m'),  o' = o e^(m - m') + e^(A - m') v,

and ends with out = o / l and lse = m + log l. The send of the next block is posted (`Ring.shift` of
distlab/comm/ring.py: one batch_isend_irecv to r+1 and from r-1) before the block math and waited for
after it, so the transfer runs beside the compute. The (m, l)
update is `distlab.pieces.online_softmax.online_fold`: the fold that gives lesson 25's streamed contrastive
step its log-normalisers is the fold that merges attention blocks here. One function, imported by both.

Backward (as FlashAttention's): delta = rowsum(dout * out); the k/v blocks go round again, and with
each travels its gradient accumulator (dk, dv); every rank recomputes the tile's probabilities
omega = e^(A - lse) from the saved lse and dA = omega * (dout v^T - delta), adds dq += dA k / sqrt(d_h)
to its own dq and dk += dA^T q / sqrt(d_h), dv += omega^T dout to the travelling accumulators, and passes
them on; after P moves they are home. A rank holds at most two received k/v pairs at once (the one in
use, the one arriving), measured with distlab.proof.memory.PeakMemory against a formula. That is less than the
whole sequence's k and v only from some P: at P = 2 the rank's own pair and the one received are the
whole; section 5 tables the bound against P and says from which P each pass holds less.

Causal attention skips every key after the query. With a contiguous split rank r computes r + 1
tiles of side seq/P (rank P-1 does P times rank 0's work); the zig-zag split (rank r holds pieces
r and 2P-1-r of 2P) gives every rank 2P - 1 full tiles and 2 diagonals of side seq/(2P): equal work.

Bytes each rank sends, with a block of h (seq/P) d_h values: forward 2 (P-1) blocks (k and v,
P-1 moves), backward 2 (P-1) + 2P blocks (k and v again; dk and dv, P moves). Everything is checked
against torch's scaled_dot_product_attention on the whole sequence in one process.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist

from distlab.comm.agree import rank_table
from distlab.comm.ring import Ring
from distlab.layer_split.context_parallel import attention, whole_sequence
from distlab.layer_split.context_parallel import split as layouts
from distlab.layer_split.context_parallel.attention import Partial, Saved, causal_mask, fold_tile, tile_grads
from distlab.layer_split.context_parallel.cost import Sizes, beats_whole
from distlab.layer_split.context_parallel.split import DIAGONAL, SKIP, Layout, piece_label
from distlab.pieces.online_softmax import online_fold
from distlab.processes.console import print0, rows_table
from distlab.processes.flags import check_flags_against_world, positive_int
from distlab.processes.identity import Runtime
from distlab.processes.runtime import distributed, run_main
from distlab.proof.cli import lesson_parser
from distlab.proof.compare import DTYPES, all_ok, compare, comparison_table
from distlab.proof.memory import PeakMemory
from distlab.proof.verdict import Verdict

# ---- the mechanism: ring attention, forward and backward -----------------------------------------


def ring_forward(ring: Ring, q, k, v, layout: Layout, tally: Counter):
    """(out, lse) of rank r's queries against the whole sequence; k/v blocks travel the ring."""
    mine = layout.pieces(ring.rank)
    out, lse = torch.empty_like(q), q.new_empty(q.shape[:-1])
    parts = [Partial.start(out[..., rows, :]) for rows, _ in mine]  # o accumulates in place in out
    kv = (k, v)
    for step in range(ring.world_size):
        source = (ring.rank - step) % ring.world_size  # whose k/v block this rank holds now
        arriving = ring.shift(*kv) if step < ring.world_size - 1 else None  # posted ahead of the math
        for (rows, positions), part in zip(mine, parts):
            for cols, key_positions in layout.pieces(source):
                kind = layouts.tile_kind(positions, key_positions, layout.causal)
                if kind == SKIP:
                    continue
                mask = causal_mask(positions, key_positions, q.device) if kind == DIAGONAL else None
                fold_tile(part, q[..., rows, :], kv[0][..., cols, :], kv[1][..., cols, :], mask)
                tally[kind] += 1
                tally["products"] += len(positions) * len(key_positions)
                tally[f"step {step}"] += 1
        if arriving is not None:
            kv = tuple(arriving.wait())  # the block we used is dropped: two blocks at most
    for (rows, _), part in zip(mine, parts):
        part.finish(lse[..., rows])  # out = o / l, lse = m + log l
    return out, lse


def ring_backward(ring: Ring, saved: tuple, dout, layout: Layout):
    """(dq, dk, dv) of rank r's block: dq stays, (dk, dv) travel with their k/v block back home."""
    q, k, v, out, lse = saved
    delta = (dout * out).sum(-1)  # rowsum(dout * out) = rowsum(omega * (dout v^T)) over all keys
    dq, kv, dkv = torch.zeros_like(q), (k, v), (torch.zeros_like(k), torch.zeros_like(v))
    mine = layout.pieces(ring.rank)
    for step in range(ring.world_size):
        source = (ring.rank - step) % ring.world_size
        arriving = ring.shift(*kv) if step < ring.world_size - 1 else None
        for rows, positions in mine:
            here = Saved(q[..., rows, :], dout[..., rows, :], lse[..., rows], delta[..., rows])
            for cols, key_positions in layout.pieces(source):
                kind = layouts.tile_kind(positions, key_positions, layout.causal)
                if kind == SKIP:
                    continue
                mask = causal_mask(positions, key_positions, q.device) if kind == DIAGONAL else None
                d_q, d_k, d_v = tile_grads(here, kv[0][..., cols, :], kv[1][..., cols, :], mask)
                dq[..., rows, :] += d_q
                dkv[0][..., cols, :] += d_k
                dkv[1][..., cols, :] += d_v
        dkv = tuple(ring.shift(*dkv).wait())  # the accumulators move on with their block
        if arriving is not None:
            kv = tuple(arriving.wait())
    return dq, dkv[0], dkv[1]  # after P moves, the accumulators of this rank's own block


class RingAttention(torch.autograd.Function):
    """attention(q, k, v) over the sequence split by `layout`, forward and backward by the ring."""

    @staticmethod
    def forward(ctx, q, k, v, ring: Ring, layout: Layout, tally: Counter):
        out, lse = ring_forward(ring, q, k, v, layout, tally)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.layout = ring, layout
        return out

    @staticmethod
    def backward(ctx, dout):
        dq, dk, dv = ring_backward(ctx.ring, ctx.saved_tensors, dout.contiguous(), ctx.layout)
        return dq, dk, dv, None, None, None


# ---- one run of the ring, and the reference ------------------------------------------------------


@dataclass(frozen=True)
class RingRun:
    """One ring attention forward + backward: the whole sequence's results gathered from the ranks,
    what each rank computed and sent, and this rank's peak memory."""

    results: dict
    tallies: list  # per rank: [full tiles, diagonal tiles, products, tiles at step 0, 1, ...]
    sent: tuple  # bytes (forward, backward) this rank sent, counted
    peak_bytes: tuple  # (forward, backward) of this rank
    largest_bytes: int  # the largest single tensor the ring made, forward or backward


def make_inputs(args) -> list[torch.Tensor]:
    """q, k, v and the upstream gradient dout of the whole sequence, the same on every rank."""
    return whole_sequence.inputs(args.seed, args.heads, args.seq_len, args.head_dim, DTYPES[args.dtype])


def gather(rt: Runtime, block: torch.Tensor, split: str) -> torch.Tensor:
    blocks = [torch.empty_like(block) for _ in range(rt.world_size)]
    dist.all_gather(blocks, block.contiguous())
    return layouts.unshard(blocks, split)


def run_ring(rt: Runtime, inputs: list[torch.Tensor], layout: Layout) -> RingRun:
    q, k, v, dout = (layouts.shard(t, rt.rank, rt.world_size, layout.split).to(rt.device) for t in inputs)
    for t in (q, k, v):
        t.requires_grad_()
    ring, tally = Ring(), Counter()
    with PeakMemory() as forward:
        out = RingAttention.apply(q, k, v, ring, layout, tally)
    sent_forward = ring.ledger.sent
    with PeakMemory() as backward:
        out.backward(dout)
    local = {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
    counts = [tally["full"], tally["diagonal"], tally["products"]]
    tallies = rank_table(counts + [tally[f"step {i}"] for i in range(rt.world_size)], rt.device).long().tolist()
    return RingRun(
        {name: gather(rt, t, layout.split).cpu() for name, t in local.items()},
        tallies,
        (sent_forward, ring.ledger.sent - sent_forward),
        (forward.peak_bytes, backward.peak_bytes),
        max(forward.largest_bytes, backward.largest_bytes),
    )


# ---- the chapter, part by part -------------------------------------------------------------------

CASES = (("zigzag", False), ("zigzag", True), ("contiguous", True))


def show_exactness(rt: Runtime, args, verdict: Verdict) -> dict:
    print0("\n[bold]1. Ring attention against scaled_dot_product_attention on the whole sequence[/]")
    inputs, runs = make_inputs(args), {}
    for split, causal in CASES:
        name = f"{split}, {'causal' if causal else 'not causal'}"
        runs[(split, causal)] = run = run_ring(rt, inputs, Layout(rt.world_size, args.seq_len, split, causal))
        rows = compare(whole_sequence.reference(inputs, causal), run.results)
        verdict.check(f"{name}: out, dq, dk, dv = SDPA's", all_ok(rows))
        print0(comparison_table(rows, f"{name}: P = {rt.world_size} ranks, gathered, against one process"))
    return runs


def show_timeline(rt: Runtime, args, run: RingRun, verdict: Verdict) -> None:
    print0("\n[bold]2. The ring: whose k/v block each rank holds at each step (tiles computed)[/]")
    world, cells = rt.world_size, []
    for r in range(world):
        held = [(r - i) % world for i in range(world)]
        cells.append(
            (
                f"rank {r}",
                *(f"r{s} {piece_label(s, world, args.seq_len)} ({run.tallies[r][3 + i]})" for i, s in enumerate(held)),
            )
        )
    print0("causal, zig-zag; a cell: r<s> <its pieces of 2P> (<tiles computed>)", highlight=False)
    print0(rows_table("", ("", *(f"step {i}" for i in range(world))), cells))
    verdict.figure(
        "timeline",
        [
            [
                {
                    "source": (r - i) % world,
                    "pieces": piece_label((r - i) % world, world, args.seq_len),
                    "tiles": run.tallies[r][3 + i],
                }
                for i in range(world)
            ]
            for r in range(world)
        ],
    )


def show_work(rt: Runtime, args, runs: dict, verdict: Verdict) -> None:
    print0("\n[bold]3. Causal work per rank: query-key products computed, zig-zag against contiguous[/]")
    world, rows, counted = rt.world_size, [], {}
    for split in layouts.SPLITS:
        tallies = runs[(split, True)].tallies
        counted[split] = [t[2] for t in tallies]
        formula = [layouts.work_formula(r, world, args.seq_len, split, True) for r in range(world)]
        layout = [layouts.count_work(r, world, args.seq_len, split, True) for r in range(world)]
        verdict.check(
            f"{split}: products per rank counted = formula = the layout's count",
            counted[split] == formula == [w.products for w in layout]
            and [t[:2] for t in tallies] == [[w.full, w.diagonal] for w in layout],
        )
        rows += [
            (f"{split}, rank {r}", f"{t[0]} + {t[1]}", str(t[2]), str(f))
            for r, (t, f) in enumerate(zip(tallies, formula))
        ]
    print0("tiles: full + diagonal; formula: zig-zag (2P+1)(seq/2P)^2, contiguous (r+1)(seq/P)^2", highlight=False)
    print0(rows_table("", ("", "tiles", "products", "formula"), rows))
    balanced = len(set(counted["zigzag"])) == 1
    skewed = world == 1 or max(counted["contiguous"]) == world * min(counted["contiguous"])
    verdict.check("zig-zag: equal work per rank; contiguous: last rank P x first's", balanced and skewed)
    verdict.figure("work", counted)


def show_bytes(rt: Runtime, sizes: Sizes, runs: dict, verdict: Verdict) -> None:
    print0("\n[bold]4. Bytes each rank sends, against the formula[/]")
    formula = sizes.expected_bytes()
    every = rank_table([b for run in runs.values() for b in run.sent], rt.device).long().tolist()
    verdict.check(
        "bytes sent = 2(P-1) blocks forward, 4P-2 backward",
        all(tuple(sent[i : i + 2]) == formula for sent in every for i in range(0, len(sent), 2)),
    )
    rows = [(f"rank {r}", f"{sent[2]:,}", f"{sent[3]:,}") for r, sent in enumerate(every)]  # causal zig-zag
    rows.append(("formula", f"{formula[0]:,}", f"{formula[1]:,}"))
    print0(f"causal zig-zag; a block is h (seq/P) d_h values = {sizes.block:,} bytes", highlight=False)
    print0(rows_table("", ("", "forward bytes", "backward bytes"), rows))
    verdict.figure("bytes", {"block": sizes.block, "forward": formula[0], "backward": formula[1]})


def show_memory(rt: Runtime, sizes: Sizes, run: RingRun, verdict: Verdict) -> None:
    print0("\n[bold]5. Memory per rank: k/v blocks in flight, against the whole sequence's k and v[/]")
    formula, whole, largest = sizes.memory_bound(), sizes.whole_kv(), max(sizes.block, sizes.tile)
    peaks = rank_table([*run.peak_bytes, run.largest_bytes], rt.device).long().tolist()
    rows = [(f"rank {r}", *(f"{b:,}" for b in row)) for r, row in enumerate(peaks)]
    rows.append(("formula (bound)", f"{formula[0]:,}", f"{formula[1]:,}", f"{largest:,}"))
    print0(
        "bytes allocated inside the ring (distlab.proof.memory.PeakMemory); "
        f"the whole sequence's k and v would be {whole:,}",
        highlight=False,
    )
    print0(rows_table("", ("", "forward peak", "backward peak", "largest tensor"), rows))
    verdict.check(
        "peak memory per rank within its formula; no tensor over a block or tile",
        all(f <= formula[0] and b <= formula[1] and big <= largest for f, b, big in peaks),
    )
    verdict.figure("memory", {"peaks": peaks, "formula": formula, "whole_kv": whole, "largest": largest})
    show_memory_against_p(sizes, verdict)


def show_memory_against_p(sizes: Sizes, verdict: Verdict) -> None:
    """The bound (held by the measurement above at this P) at every P whose zig-zag split fits seq."""
    worlds = [p for p in range(2, 17) if sizes.seq_len % (2 * p) == 0]
    rows = [(f"P = {p}", *(f"{b:,}" for b in sizes.at(p).memory_bound()), f"{sizes.whole_kv():,}") for p in worlds]
    print0(rows_table("The bound per rank against P, at this seq", ("", "forward", "backward", "whole k, v"), rows))
    forward, backward = beats_whole(sizes, worlds)
    print0(
        f"A block is h (seq/P) d_h e bytes. From P = 3 the bound is a fixed number of blocks, so it shrinks as 1/P "
        f"(the tiles faster), while the whole sequence's k and v stay {sizes.whole_kv():,} bytes. At P = 2 a rank "
        f"holds both pairs, the whole; the ring's forward holds less from P = {forward or '-'}, "
        f"its backward from P = {backward or '-'} (of the P that divide seq into 2P pieces).",
        highlight=False,
    )
    verdict.figure("memory_against_p", {"worlds": worlds, "forward_from": forward, "backward_from": backward})


def show_fold(verdict: Verdict) -> None:
    print0("\n[bold]6. One fold: ring attention and the streamed contrastive step[/]")
    # the streamed step (lesson 25) stands on the same ground-floor fold; its side of the claim is
    # tests/test_lesson09_context_parallel.py's, so this lesson imports nothing of a later part
    fold = attention.online_fold
    print0(f"the fold ring attention calls: {fold.__module__}.{fold.__qualname__}", highlight=False)
    print0("lesson 25's streamed step takes its log-normalisers from the same function", highlight=False)
    verdict.check("one online fold for ring attention and lesson 25", fold is online_fold)


def parse_args():
    parser = lesson_parser(__doc__)
    parser.add_argument("--seq-len", type=positive_int, default=48, help="sequence length seq (2P must divide it)")
    parser.add_argument("--heads", type=positive_int, default=2, help="attention heads h")
    parser.add_argument("--head-dim", type=positive_int, default=16, help="width of a head d_h")
    parser.add_argument("--dtype", choices=DTYPES, default="float64", help="dtype of q, k, v")
    return parser.parse_args()


def main() -> int:
    args = check_flags_against_world(parse_args(), lambda a, world: layouts.check_seq_len(a.seq_len, world, "zigzag"))
    with distributed(args.device) as rt:
        verdict = Verdict(rt)
        print0(
            f"[bold]Lesson 09: context parallelism, ring attention[/] - P = {rt.world_size}, "
            f"seq = {args.seq_len}, h = {args.heads}, d_h = {args.head_dim}, {args.dtype}, {rt.backend}"
        )
        runs = show_exactness(rt, args, verdict)
        show_timeline(rt, args, runs[("zigzag", True)], verdict)
        show_work(rt, args, runs, verdict)
        sizes = Sizes(args.heads, args.seq_len, args.head_dim, rt.world_size, DTYPES[args.dtype].itemsize)
        show_bytes(rt, sizes, runs, verdict)
        show_memory(rt, sizes, runs[("zigzag", True)], verdict)
        show_fold(verdict)
        return verdict.finish(args.json)


if __name__ == "__main__":
    run_main(main)
