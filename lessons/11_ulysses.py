"""Lesson 11: Ulysses sequence parallelism. The sequence is split over the ranks as in lesson 09, but attention
runs on whole sequences: one all-to-all turns the sequence split into a head split, and one turns it back.

    torchrun --nproc-per-node 4 lessons/11_ulysses.py     # P must divide h (--heads) and seq (--seq-len)

Rank r holds positions r seq/P .. (r+1) seq/P - 1 of q, k and v, every head: h x seq/P x d_h each (lesson
09's block). Attention mixes positions and never heads, so DeepSpeed-Ulysses (Jacobs et al. 2023,
https://arxiv.org/abs/2309.14509) moves the data instead of the keys:

  1. all-to-all of q, k and v: cut each block into P groups of h/P heads and send group q to rank q; from
     every rank s arrive its seq/P positions of my heads, stacked in rank order, which is position order:
     h/P x seq x d_h, whole sequences of h/P heads;
  2. attention on them, torch's scaled_dot_product_attention as it is, causal or not: the heads never
     meet, and a whole sequence needs no online softmax and no mask bookkeeping;
  3. all-to-all of the output back: cut it by positions, send rank s its seq/P positions; from every rank
     arrive my positions of its heads: h x seq/P x d_h, the sequence split again.

Backward: an all-to-all's gradient is the reverse all-to-all (lesson 10; `distlab.comm.differentiable`),
and SDPA's backward is SDPA's. So backward sends what forward sent: dout to the head split, dq, dk, dv back.

Bytes each rank sends: an all-to-all keeps 1/P of a block (its own positions of its own heads) and sends the
rest, (P-1)/P of a block; four of them each way, 4 (P-1)/P blocks forward and as many backward. Ring
attention (lesson 09) sends 2 (P-1) blocks forward and 4P - 2 backward: the same forward at P = 2, more
from P = 3 on, and at a fixed seq its bytes per rank do not shrink with P where Ulysses' do
(`distlab/layer_split/context_parallel/ulysses.py`). What Ulysses pays instead: every rank talks to every other at once
(an all-to-all, slower than a neighbour's link across nodes), and P can be at most h, P dividing h (with
grouped-query attention, the key/value heads). Ring attention has no such limit, talks to neighbours only and
hides its transfers behind the block math, once there is enough of it. Causal work is even by construction
here: every rank computes whole causal sequences for its h/P heads, no zig-zag needed.

The crossover (section 4). A ring step computes one q block against one k/v block while the next k/v pair
travels. With c = seq/P positions a rank, the step's attention is 4 c^2 h d_h FLOPs (q k^T and p v, 2 c^2 d_h
each per head) and its transfer 2 c h d_h e bytes (k and v). At F FLOP/s and B bytes/s the transfer hides when
4 c^2 h d_h / F >= 2 c h d_h e / B, that is when c >= F e / (2 B): a length per rank, whatever h and d_h are
(causal, half the block work on average: twice it). On an H100 in bf16 that is about 2,200 positions a rank
over NVLink and 20,000 across nodes on a 400 Gb/s NIC; below it the ring waits on the wire, and Ulysses'
all-to-all, which no block math can hide, moves fewer bytes for it.

The hybrid (USP, Fang and Zhao 2024, https://arxiv.org/abs/2405.07719; LoongTrain's 2D attention): P = P_u x
P_r ranks, P_u in a node, P_r nodes. The sequence is cut into P_r node chunks; inside a node Ulysses' all-to-all
turns its P_u pieces of the node's chunk into the whole chunk of h/P_u heads per rank, over the fast links; across
nodes the ranks holding the same heads form a ring of P_r and run ring attention on the chunks, its transfers
hidden once a chunk is long enough (c = seq/P_r >= the crossover). P may exceed h (up to h P_r), the all-to-all
never leaves a node, and only neighbour transfers cross the slow links.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from distlab.comm.agree import rank_table
from distlab.comm.differentiable import all_to_all
from distlab.comm.ledger import Ledger
from distlab.layer_split.context_parallel import ulysses, whole_sequence
from distlab.layer_split.context_parallel.cost import Sizes
from distlab.layer_split.context_parallel.split import shard, unshard
from distlab.processes.console import print0, rows_table
from distlab.processes.flags import check_flags_against_world, positive_int
from distlab.processes.identity import Runtime
from distlab.processes.runtime import distributed, run_main
from distlab.proof.cli import lesson_parser
from distlab.proof.compare import DTYPES, all_ok, compare, comparison_table
from distlab.proof.hardware import DEVICES, LINKS
from distlab.proof.verdict import Verdict

PHASES = ("forward", "backward")  # the ledger's phase of a move, and of its gradient's move back

# ---- the mechanism: sequence split to head split and back ----------------------------------------


def seq_to_heads(x: torch.Tensor, ledger: Ledger, phases: tuple[str, str], group=None) -> torch.Tensor:
    """(h, seq/P, d_h), my positions of every head -> (h/P, seq, d_h), every position of my heads."""
    p = dist.get_world_size(group)
    heads, local, head_dim = x.shape
    group_of = [heads // p] * p  # rows (heads) for every rank: head group q goes to rank q
    rows = all_to_all(x.reshape(heads, local * head_dim), group_of, group_of, group, ledger, phases)
    # arrived: from each rank s (in order), its positions of my h/P heads; positions s seq/P .. in order
    return rows.view(p, heads // p, local, head_dim).transpose(0, 1).reshape(heads // p, p * local, head_dim)


def heads_to_seq(y: torch.Tensor, ledger: Ledger, phases: tuple[str, str], group=None) -> torch.Tensor:
    """(h/P, seq, d_h), every position of my heads -> (h, seq/P, d_h), my positions of every head."""
    p = dist.get_world_size(group)
    mine, seq, head_dim = y.shape
    local = seq // p
    by_rank = y.view(mine, p, local, head_dim).transpose(0, 1).reshape(p * mine, local * head_dim)  # rank s: its
    rows = all_to_all(by_rank, [mine] * p, [mine] * p, group, ledger, phases)  # positions, every one of my heads
    return rows.view(p * mine, local, head_dim)  # from rank q its head group q: the heads in order


def ulysses_attention(q, k, v, causal: bool, ledger: Ledger, group=None) -> torch.Tensor:
    """Attention of this rank's positions (h, seq/P, d_h each) against the whole sequence: head split,
    SDPA on whole sequences of h/P heads, sequence split again. Differentiable."""
    whole = [seq_to_heads(t, ledger, PHASES, group) for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*whole, is_causal=causal)  # (h/P, seq, d_h)
    return heads_to_seq(out, ledger, PHASES, group)


# ---- the runs ------------------------------------------------------------------------------------


def make_inputs(args) -> list[torch.Tensor]:
    """q, k, v and the upstream gradient dout of the whole sequence, the same on every rank."""
    return whole_sequence.inputs(args.seed, args.heads, args.seq_len, args.head_dim, DTYPES[args.dtype])


def run_ulysses(rt: Runtime, inputs: list[torch.Tensor], causal: bool) -> tuple[dict, tuple[int, int]]:
    """Ulysses forward and backward on this rank's block: (the whole sequence's results, gathered from
    every rank; the bytes this rank sent, forward and backward)."""
    q, k, v, dout = (shard(t, rt.rank, rt.world_size, "contiguous").to(rt.device) for t in inputs)
    for t in (q, k, v):
        t.requires_grad_()
    ledger = Ledger()
    out = ulysses_attention(q, k, v, causal, ledger)
    out.backward(dout)
    local = {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
    return {name: gather(rt, t) for name, t in local.items()}, (ledger.sent_in("forward"), ledger.sent_in("backward"))


def gather(rt: Runtime, block: torch.Tensor) -> torch.Tensor:
    blocks = [torch.empty_like(block) for _ in range(rt.world_size)]
    dist.all_gather(blocks, block.contiguous())
    return unshard([b.cpu() for b in blocks], "contiguous")


# ---- the chapter, part by part -------------------------------------------------------------------


def show_layouts(rt: Runtime, args) -> None:
    print0("\n[bold]1. What each rank holds: the sequence split, then the head split[/]")
    p, local, mine = rt.world_size, args.seq_len // rt.world_size, args.heads // rt.world_size
    rows = [
        (
            f"rank {r}",
            f"0..{args.heads - 1}",
            f"{r * local}..{(r + 1) * local - 1}",
            f"{r * mine}..{(r + 1) * mine - 1}",
        )
        for r in range(p)
    ]
    print0(f"blocks of h x seq/P x d_h = {args.heads} x {local} x {args.head_dim}; heads of h/P = {mine}")
    print0(rows_table("", ("", "heads held", "positions held", "heads in attention"), rows))


def show_exactness(rt: Runtime, args, verdict: Verdict) -> dict:
    print0("\n[bold]2. Ulysses against scaled_dot_product_attention on the whole sequence[/]")
    inputs, sent = make_inputs(args), {}
    for causal in (False, True):
        name = "causal" if causal else "not causal"
        results, sent[name] = run_ulysses(rt, inputs, causal)
        rows = compare(whole_sequence.reference(inputs, causal), results)
        verdict.check(f"{name}: out, dq, dk, dv = SDPA's", all_ok(rows))
        print0(comparison_table(rows, f"{name}: P = {rt.world_size} ranks, gathered, against one process"))
    return sent


def show_bytes(rt: Runtime, args, sent: dict, verdict: Verdict) -> None:
    print0("\n[bold]3. Bytes each rank sends, against the formula and against ring attention's[/]")
    sizes = Sizes(args.heads, args.seq_len, args.head_dim, rt.world_size, DTYPES[args.dtype].itemsize)
    formula = ulysses.expected_bytes(sizes)
    every = rank_table([b for pair in sent.values() for b in pair], rt.device).long().tolist()
    verdict.check(
        "bytes sent = 4 (P-1)/P blocks forward, as many backward",
        all(tuple(row[i : i + 2]) == formula for row in every for i in (0, 2)),
    )
    rows = [(f"rank {r}", f"{row[2]:,}", f"{row[3]:,}") for r, row in enumerate(every)]  # causal
    rows.append(("formula", f"{formula[0]:,}", f"{formula[1]:,}"))
    print0(f"causal; a block is h (seq/P) d_h values = {sizes.block:,} bytes", highlight=False)
    print0(rows_table("", ("", "forward bytes", "backward bytes"), rows))
    worlds = [p for p in range(1, args.heads + 1) if args.heads % p == 0 and args.seq_len % p == 0]
    table = ulysses.bytes_beside_ring(args.heads, args.seq_len, args.head_dim, sizes.itemsize, worlds)
    shown = [
        (str(t["P"]), f"{t['block']:,}", *(f"{b:,}" for b in t["ulysses"]), *(f"{b:,}" for b in t["ring"]))
        for t in table
    ]
    print0(f"Per rank, by the formulas, at every P dividing h = {args.heads} and seq = {args.seq_len}", highlight=False)
    print0(rows_table("", ("P", "block", "Ulysses fwd", "Ulysses bwd", "ring fwd", "ring bwd"), shown))
    verdict.check(
        "Ulysses sends no more than ring attention at any P (equal forward at P = 2)",
        all(t["ulysses"][0] <= t["ring"][0] and t["ulysses"][1] <= t["ring"][1] for t in table),
    )
    verdict.figure("bytes", {"counted": every, "formula": formula, "beside_ring": table})


def crossover(flops: float, itemsize: int, bandwidth: float) -> float:
    """c*: the positions a rank at which a ring step's attention (4 c^2 h d_h FLOPs at `flops`) lasts as long as
    its k, v transfer (2 c h d_h e bytes at `bandwidth`): c* = F e / (2 B), not causal."""
    return flops * itemsize / (2 * bandwidth)


def show_crossover(rt: Runtime, args, verdict: Verdict) -> None:
    print0("\n[bold]4. When the ring's transfers hide: c = seq/P >= F e / (2 B), by the formula[/]")
    gpu, rows, found = DEVICES["h100"], [], {}
    for link in LINKS["h100"]:
        c = crossover(gpu.peak["bf16"], 2, link.bandwidth)
        found[link.name] = c
        rows.append((f"{link.name}, {link.bandwidth / 1e9:g} GB/s", f"{c:,.0f}", f"{2 * c:,.0f}"))
    c = args.seq_len // rt.world_size
    hidden = [name for name, at in found.items() if c >= at]
    print0(
        f"{gpu.name}, bf16 (e = 2), {gpu.peak['bf16'] / 1e12:g} TFLOP/s; here c = {c}: "
        + (f"hidden on {', '.join(hidden)}" if hidden else "the ring waits on either link"),
        highlight=False,
    )
    print0(rows_table("", ("link (one direction)", "c*, full attention", "c*, causal"), rows))
    verdict.figure("crossover", {"device": gpu.name, "positions_per_rank": found})


def parse_args():
    parser = lesson_parser(__doc__)
    parser.add_argument("--seq-len", type=positive_int, default=24, help="sequence length seq (P must divide it)")
    parser.add_argument("--heads", type=positive_int, default=12, help="attention heads h (P must divide it)")
    parser.add_argument("--head-dim", type=positive_int, default=4, help="width of a head d_h")
    parser.add_argument("--dtype", choices=DTYPES, default="float64", help="dtype of q, k, v")
    return parser.parse_args()


def main() -> int:
    args = check_flags_against_world(parse_args(), lambda a, p: ulysses.check_split(a.heads, a.seq_len, p))
    with distributed(args.device) as rt:
        verdict = Verdict(rt)
        print0(
            f"[bold]Lesson 11: Ulysses sequence parallelism[/] - P = {rt.world_size}, seq = {args.seq_len}, "
            f"h = {args.heads}, d_h = {args.head_dim}, {args.dtype}, {rt.backend}"
        )
        show_layouts(rt, args)
        sent = show_exactness(rt, args, verdict)
        show_bytes(rt, args, sent, verdict)
        show_crossover(rt, args, verdict)
        return verdict.finish(args.json)


if __name__ == "__main__":
    run_main(main)
