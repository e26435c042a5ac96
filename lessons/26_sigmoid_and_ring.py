"""Lesson 26: the sigmoid loss (SigLIP) and the ring. The exact streamed gradient of SigLIP's loss, and
an exchange in which no rank ever holds N x d: C x d blocks pass from rank to rank.

    torchrun --nproc-per-node 2 lessons/26_sigmoid_and_ring.py    # any P; N = C P with C fixed

The sigmoid loss. S = s Z_x Z_y^T + beta with a learned scale s and bias beta (not b: b_j is a column
LSE), labels eps_ij = +1 on the diagonal and -1 elsewhere, L = -(1/N) sum_ij log sigma(eps_ij S_ij). No
normaliser couples a row, so the gradient is closed-form tile by tile (log sigma via softplus: stable for
|S| in the hundreds):

    D_ij = dL/dS_ij = -(1/N) eps_ij sigma(-eps_ij S_ij)     G_x = s D Z_y     G_y = s D^T Z_x
    dL/ds = sum_i z_i^x . (D Z_y)_i                      dL/dbeta = sum_ij D_ij

The ring (Inf-CL, Wang et al. 2024, https://arxiv.org/abs/2410.17243; open_clip's `shift` exchange).
Rank r keeps z_x^r, z_y^r. At step k it holds rank j = r - k's text block: it posts that block to
r + 1 *before* the tiles that read it, computes its C x C tiles (G_x for its rows, and D^T z_x^r for
block j's columns), folds them into j's traveling accumulator and posts that on too; after P hops the
accumulator is home with G_y. Per rank: (P - 1) C d feature elements and P C d accumulator elements,
and memory bounded at fixed C: at most 10 C x d blocks and 4 tiles whatever P (it grows from P = 1 to 3,
as a middle step appears, then stays), where the gather holds N x 2d, growing with P. The price is bytes:
(2P - 1) / (2P - 2) times the gather's (P - 1) C 2d for the sigmoid (1.5x at P = 2, 1.17x at P = 4), and
about (3P - 2) / (2P - 2) for InfoNCE's two walks (2.0x, 1.67x; measured beside the memory table).
The InfoNCE ring is the same walk twice: pass 1 folds each tile into the rank's row (m, l) and a
traveling column (m, l) (the online fold of src/distlab/pieces/online_softmax.py, the one lesson 25 streams a
and b with), pass 2 forms R + Q - 2 delta and carries G_y home: 4 C N d multiply-adds against the
gather's 6 C N d.

The mechanism is written out below: `closed_form_grads`, the sigmoid ring `ring_by_hand`, and the InfoNCE
ring in its two passes, `infonce_ring_by_hand`, on whole C x C blocks. Pass 1 makes each block of S once:
my rows' (m, l) stay with me, the visiting block's column (m, l) travels with it (`ring_walk`: a block is
posted on before the math, its accumulator after), and after P hops my own columns' (m, l) are home: a
and b for my pairs. Pass 2 walks the text blocks again, each with its b_j, forms R + Q - 2 delta, adds
(R + Q - 2 delta) z_y^j into my G_x and sends (R + Q - 2 delta)^T z_x^r on with block j, home as G_y. The
library's versions are src/distlab/streamed/sigmoid.py and ring.py (T x T tiles, the fused kernels),
wired into `distributed_backward` by what the model returns ((z_x, z_y, s, beta) selects the sigmoid
loss) and by EXCHANGE: "ring" in the config.

The self-check: the closed form against autograd; each hand ring against the library's; every
{InfoNCE, sigmoid} x {gather, ring} step against a deep copy on the whole batch (plain autograd, each
rank's dropout replayed); the bytes each rank sent against the formula; the ring's memory against a
bound that does not grow with P, and its bytes against the gather's.
"""

from __future__ import annotations

import copy
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from rich.table import Table
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distlab.comm.ledger import Ledger
from distlab.comm.p2p import post
from distlab.pieces.chunks import balanced_chunks
from distlab.pieces.online_softmax import online_fold, rescale
from distlab.processes.console import print0
from distlab.processes.flags import fraction, positive_int
from distlab.processes.runtime import distributed, run_main
from distlab.proof.cli import lesson_parser
from distlab.proof.compare import all_ok, compare, grads_of
from distlab.proof.memory import PeakMemory
from distlab.proof.models import TwoTower, paired_data
from distlab.proof.verdict import Verdict
from distlab.streamed import loss_machinery
from distlab.streamed.config import EXCHANGES
from distlab.streamed.exchange import expected_bytes, step_ledger
from distlab.streamed.ring_passes import P2PRing, expected_ring_bytes, infonce_ring, sigmoid_ring
from distlab.streamed.sigmoid import Logits
from distributed_clip import distributed_backward

LOSSES = ("infonce", "sigmoid")


def parse_args():
    parser = lesson_parser(__doc__)
    parser.add_argument("--pairs-per-rank", type=positive_int, default=48, help="C, fixed: N = C P")
    parser.add_argument("--micro-batch-size", type=positive_int, default=20, help="B (B < C: recompute)")
    parser.add_argument("--stream-chunk", type=positive_int, default=16, help="T: tiles are at most T x T")
    parser.add_argument("--dropout", type=fraction, default=0.1, help="dropout in both towers")
    parser.add_argument("--memory-pairs", type=positive_int, default=512, help="C of the memory measurement")
    return parser.parse_args()


class SigLipTwoTower(TwoTower):
    """TwoTower with SigLIP's head: forward returns (z_x, z_y, s = exp(logit_scale), b), s = 10 and beta = -10
    at the start (open_clip's init_logit_bias); without a bias, (z_x, z_y, s): the InfoNCE."""

    def __init__(self, bias: bool, **kwargs):
        super().__init__(**kwargs)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(10.0), dtype=torch.float64))
        self.logit_bias = nn.Parameter(torch.tensor(-10.0, dtype=torch.float64)) if bias else None

    def forward(self, x, y):
        z_x, z_y = super().forward(x, y)
        head = (self.logit_scale.exp(),) + ((self.logit_bias,) if self.logit_bias is not None else ())
        return (z_x, z_y, *head)


# ---- the mechanism: the sigmoid loss's closed form, and the ring by hand -------------------------


def sigmoid_loss(z_x, z_y, s, beta):
    labels = 2 * torch.eye(len(z_x), dtype=z_x.dtype, device=z_x.device) - 1
    return -F.logsigmoid(labels * (s * z_x @ z_y.T + beta)).sum() / len(z_x)


def infonce(z_x, z_y, s):
    logits, labels = s * z_x @ z_y.T, torch.arange(len(z_x), device=z_x.device)
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2


def closed_form_grads(z_x, z_y, s: float, beta: float):
    """(L, G_x, G_y, dL/ds, dL/dbeta) from the formulas above, on the whole N x N (the lesson's check;
    the library does the same in T x T tiles and never makes N x N)."""
    n, labels = len(z_x), 2 * torch.eye(len(z_x), dtype=z_x.dtype, device=z_x.device) - 1
    logits = s * z_x @ z_y.T + beta
    d = -labels * torch.sigmoid(-labels * logits) / n  # D = dL/dS
    g_x, g_y = s * d @ z_y, s * d.T @ z_x
    return F.softplus(-labels * logits).sum() / n, g_x, g_y, (z_x * (d @ z_y)).sum(), d.sum()


def ring_by_hand(rt, x, y, s: float, beta: float):
    """The sigmoid ring with point-to-point messages, whole C x C blocks: (G_x, G_y for my pairs, bytes
    sent). `post` hands a send to r + 1 and a receive from r - 1 to the backend at once and returns;
    `.wait()` returns what arrived. The block goes on before the math that reads it; the accumulator
    after the math that fills it. (One rank is its own neighbour: its messages are copies, not sent.)"""
    world, r, c = rt.world_size, rt.rank, len(x)
    nxt, prv = (r + 1) % world, (r - 1) % world
    g_x, block, acc_posted, ledger = torch.zeros_like(x), y, None, Ledger()
    for k in range(world):
        j = (r - k) % world  # whose text block I hold
        if k < world - 1:
            block_posted = post([(block, nxt)], [(torch.empty_like(block), prv)], ledger=ledger)
        labels = -torch.ones(c, c, dtype=x.dtype, device=x.device)
        labels += 2 * torch.eye(c, dtype=x.dtype, device=x.device) if j == r else 0
        d = -labels * torch.sigmoid(-labels * (s * x @ block.T + beta)) / (c * world)
        g_x += s * d @ block
        mine = s * d.T @ x  # my rows' part of G_y of block j
        if acc_posted is not None:
            mine += acc_posted.wait()[0]  # what ranks j .. r - 1 added
        acc_posted = post([(mine, nxt)], [(torch.empty_like(mine), prv)], ledger=ledger)
        if k < world - 1:
            (block,) = block_posted.wait()
    (g_y,) = acc_posted.wait()  # after P hops my own block's accumulator is home, complete
    return g_x, g_y, ledger.sent


def ring_walk(rt, ahead: list, visit, merge, ledger: Ledger) -> list:
    """Every rank's block past this rank, and each block's accumulator home. At step k I hold the tensors
    `ahead` of block j = r - k (my own at k = 0) and post them to r + 1 before `visit(j, ahead)` computes
    my part of block j's accumulator; `merge(received, mine)` folds it into what ranks j .. r - 1 sent,
    and the sum goes on to r + 1. After P steps my own block's accumulator is home, complete."""
    world, r = rt.world_size, rt.rank
    nxt, prv = (r + 1) % world, (r - 1) % world
    acc_posted = None
    for k in range(world):
        j = (r - k) % world
        if k < world - 1:  # tag 0: blocks, tag 1: accumulators (two streams between the same neighbours)
            block_posted = post([(t, nxt) for t in ahead], [(torch.empty_like(t), prv) for t in ahead], None, ledger)
        mine = visit(j, ahead)
        if acc_posted is not None:
            mine = merge(acc_posted.wait(), mine)
        acc_posted = post([(t, nxt) for t in mine], [(torch.empty_like(t), prv) for t in mine], None, ledger, 1)
        if k < world - 1:
            ahead = block_posted.wait()
    return acc_posted.wait()


def merge_lse(received: list, mine: list) -> list:
    """Two column (m, l) of the online fold as one: each sum rescaled to the larger max."""
    (m_1, l_1), (m_2, l_2) = received, mine
    m = torch.maximum(m_1, m_2)
    return [m, l_1 * rescale(m_1, m) + l_2 * rescale(m_2, m)]


def infonce_ring_by_hand(rt, x, y, s: float):
    """The symmetric InfoNCE in two ring passes, whole C x C blocks: (my share of L, G_x, G_y for my
    pairs, bytes sent). 4 C N d multiply-adds: C N d in pass 1, 3 C N d in pass 2."""
    c, r, ledger = len(x), rt.rank, Ledger()
    n = c * rt.world_size
    rows = [x.new_full((c,), -math.inf), x.new_zeros(c)]  # my rows' running (m, l)

    def fold(j: int, ahead: list) -> list:  # pass 1: S_rj once, into my rows and block j's columns
        tile = s * x @ ahead[0].T
        rows[:] = online_fold(*rows, tile.clone(), dim=1)
        return list(online_fold(x.new_full((c,), -math.inf), x.new_zeros(c), tile, dim=0))

    col_m, col_l = ring_walk(rt, [y], fold, merge_lse, ledger)
    a, b = rows[0] + rows[1].log(), col_m + col_l.log()  # a_i for my rows, b_j for my columns
    loss_part = (a + b - 2 * s * (x * y).sum(1)).sum() / (2 * n)  # my pairs' share of L
    pair_y = torch.zeros_like(x)  # sum_j (R + Q - 2 delta)_ij z_j^y for my rows i

    def products(j: int, ahead: list) -> list:  # pass 2: S_rj again, its coefficients, two products
        y_j, b_j = ahead
        tile = s * x @ y_j.T
        coef = (tile - a[:, None]).exp() + (tile - b_j).exp()  # R_ij + Q_ij
        if j == r:  # my own block holds my positives on its diagonal
            coef -= 2 * torch.eye(c, dtype=x.dtype, device=x.device)
        pair_y.add_(coef @ y_j)
        return [coef.T @ x]  # my rows' part of (R + Q - 2 delta)^T Z_x for block j's columns

    (pair_x,) = ring_walk(rt, [y, b], products, lambda received, mine: [received[0] + mine[0]], ledger)
    return loss_part, s / (2 * n) * pair_y, s / (2 * n) * pair_x, ledger.sent


# ---- the chapter, part by part -------------------------------------------------------------------


def whole_batch(model, x, y, world: int, micro: int, dropout_seed: int):
    """Plain autograd on the whole batch, on a deep copy: rank r's pairs in its micro-batches, from rank
    r's random stream (the masks the step used); s and beta are ordinary tensors."""
    model, c, outs = copy.deepcopy(model).to(x.device), len(x) // world, []
    with torch.random.fork_rng(devices=[x.device] if x.device.type == "cuda" else []):
        for r in range(world):
            torch.manual_seed(dropout_seed + r)  # (the CPU's generator and every GPU's)
            rows = slice(r * c, (r + 1) * c)
            outs += [model(x[rows][part], y[rows][part]) for part in balanced_chunks(c, min(micro, c))]
    z_x, z_y = (torch.cat([o[i] for o in outs]) for i in (0, 1))
    loss = sigmoid_loss(z_x, z_y, *outs[0][2:]) if len(outs[0]) == 4 else infonce(z_x, z_y, outs[0][2])
    loss.backward()
    return grads_of(model), loss.item()


def check_closed_form(verdict, n: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    z_x, z_y = (F.normalize(torch.randn(n, 8, generator=gen, dtype=torch.float64), dim=1) for _ in range(2))
    leaves = [
        t.clone().requires_grad_()
        for t in (z_x, z_y, torch.tensor(10.0, dtype=torch.float64), torch.tensor(-10.0, dtype=torch.float64))
    ]
    auto_loss = sigmoid_loss(*leaves)
    auto_loss.backward()
    mine = closed_form_grads(z_x, z_y, 10.0, -10.0)
    worst = max((m - a).abs().max().item() for m, a in zip(mine, [auto_loss] + [t.grad for t in leaves]))
    print0(f"closed form vs autograd on N = {n}: L, G_x, G_y, dL/ds, dL/dbeta agree to {worst:.1e}")
    verdict.check("the closed-form sigmoid gradient (D, G_x, G_y, dL/ds, dL/dbeta) equals autograd's", worst < 1e-12)


def check_ring_by_hand(verdict, rt, c: int, t: int) -> None:
    n, r = c * rt.world_size, rt.rank
    gen = torch.Generator().manual_seed(1)
    z_x, z_y = (
        F.normalize(torch.randn(n, 8, generator=gen, dtype=torch.float64), dim=1).to(rt.device) for _ in range(2)
    )
    mine = slice(r * c, (r + 1) * c)
    g_x, g_y, sent = ring_by_hand(rt, z_x[mine].contiguous(), z_y[mine].contiguous(), 10.0, -10.0)
    lib = sigmoid_ring(P2PRing(rt.world_size, r), z_x[mine], z_y[mine], Logits(10.0, -10.0), t)
    _, whole_x, whole_y, _, _ = closed_form_grads(z_x, z_y, 10.0, -10.0)
    ok = all(
        torch.allclose(a, b, rtol=1e-10, atol=1e-14)
        for a, b in ((g_x, lib.g_x), (g_y, lib.g_y), (g_x, whole_x[mine]), (g_y, whole_y[mine]))
    )
    verdict.check("the ring by hand = the library's ring = the whole batch's G_x, G_y (my pairs)", ok)
    verdict.check(
        f"the hand ring sent (P-1) C d + P C d elements ({sent:,} bytes)",
        sent == 8 * ((rt.world_size - 1) * c * 8 + (rt.world_size > 1) * rt.world_size * c * 8),
    )


def check_infonce_ring_by_hand(verdict, rt, c: int, t: int) -> None:
    n, r = c * rt.world_size, rt.rank
    gen = torch.Generator().manual_seed(3)
    z_x, z_y = (
        F.normalize(torch.randn(n, 8, generator=gen, dtype=torch.float64), dim=1).to(rt.device) for _ in range(2)
    )
    mine = slice(r * c, (r + 1) * c)
    loss_part, g_x, g_y, sent = infonce_ring_by_hand(rt, z_x[mine].contiguous(), z_y[mine].contiguous(), 10.0)
    lib = infonce_ring(P2PRing(rt.world_size, r), z_x[mine], z_y[mine], 10.0, t)
    leaves = [z.clone().requires_grad_() for z in (z_x, z_y)]
    whole = infonce(*leaves, 10.0)
    whole.backward()
    shares = loss_part.clone()
    dist.all_reduce(shares)  # the ranks' shares of L add up to L
    ok = all(
        torch.allclose(a, b, rtol=1e-10, atol=1e-14)
        for a, b in ((g_x, lib.g_x), (g_y, lib.g_y), (g_x, leaves[0].grad[mine]), (g_y, leaves[1].grad[mine]))
    )
    ok = ok and torch.allclose(loss_part, lib.loss_part, rtol=1e-10) and torch.allclose(shares, whole, rtol=1e-10)
    verdict.check("the InfoNCE ring by hand = the library's ring = the whole batch's L, G_x, G_y", ok)
    formula = expected_ring_bytes(rt.world_size, c, 8, 8, "infonce")
    verdict.check(f"the InfoNCE hand ring sent what the library's formula says ({sent:,} bytes)", sent == formula)


def check_steps(verdict, rt, args) -> None:
    """distributed_backward for every (loss, exchange) against the whole batch; and its bytes."""
    c, world = args.pairs_per_rank, rt.world_size
    x, y = (t.to(rt.device) for t in paired_data(c * world, seed=args.seed))
    mine = slice(rt.rank * c, (rt.rank + 1) * c)
    table = Table(
        title=f"distributed_backward vs the whole batch (N = {c * world}, B = {args.micro_batch_size})",
        title_justify="left",
    )
    for column in ("loss", "exchange", "max rel err", "bytes sent", "formula"):
        table.add_column(column, justify="left" if column in ("loss", "exchange") else "right")
    for loss_name in LOSSES:
        for exchange in EXCHANGES:
            model = SigLipTwoTower(loss_name == "sigmoid", dropout=args.dropout, seed=args.seed).to(rt.device)
            start = copy.deepcopy(model)
            torch.manual_seed(args.seed + 1000 + rt.rank)  # each rank its own dropout stream
            config = {
                "GLOBAL_BATCH_SIZE": c * world,
                "MICRO_BATCH_SIZE": args.micro_batch_size,
                "STREAM_CHUNK_SIZE": args.stream_chunk,
                "EXCHANGE": exchange,
            }
            loss = distributed_backward(DDP(model), x[mine], y[mine], config)
            sent, formula = step_ledger.sent, expected_bytes(loss_name, exchange, (world, c, 8), (8, 8))
            ref, ref_loss = whole_batch(start, x, y, world, args.micro_batch_size, args.seed + 1000)
            rows = compare(ref, grads_of(model))
            table.add_row(loss_name, exchange, f"{max(r.max_rel for r in rows):.1e}", f"{sent:,}", f"{formula:,}")
            verdict.check(
                f"{loss_name}, {exchange}: every gradient (s, beta too) and L equal the whole batch's",
                all_ok(rows) and abs(loss - ref_loss) <= 1e-10 * abs(ref_loss),
            )
            verdict.check(f"{loss_name}, {exchange}: the bytes sent equal the formula", sent == formula)
    print0(table)


def loss_memory(rt, c: int, d: int, t: int) -> dict:
    """On this rank: the peak bytes and the bytes sent of the step's loss machinery, {InfoNCE, sigmoid} x
    {gather, ring}, on C x d random embeddings ({(loss, exchange): (peak, sent)}); and the sigmoid ring's
    timeline on this rank, "events": (rank, step, what, when). Notebook 26 runs it at P = 1-4."""
    gen = torch.Generator().manual_seed(2 + rt.rank)
    z_x, z_y = (F.normalize(torch.randn(c, d, generator=gen), dim=1).to(rt.device) for _ in range(2))
    out = {}
    for loss_name in LOSSES:
        for exchange in EXCHANGES:
            config = {
                "GLOBAL_BATCH_SIZE": c * rt.world_size,
                "MICRO_BATCH_SIZE": c,
                "STREAM_CHUNK_SIZE": t,
                "TAU": 0.1,
                "EXCHANGE": exchange,
            }
            step_ledger.clear()
            with PeakMemory() as mem:  # the step's loss machinery, as it runs in the step
                loss_machinery(z_x, z_y, config, logit_bias=-10.0 if loss_name == "sigmoid" else None)
            out[loss_name, exchange] = (mem.peak_bytes, step_ledger.sent)
    ring = P2PRing(rt.world_size, rt.rank)
    dist.barrier()  # every rank starts the ring together: the timeline shows the ring, not the wait
    sigmoid_ring(ring, z_x, z_y, Logits(10.0, -10.0), t)
    out["events"] = [(rt.rank, k, what, when) for k, what, when in ring.events]
    return out


def measure_memory(verdict, rt, c: int, t: int) -> list:
    """Peak bytes this rank's loss machinery allocates, gather against ring, at C fixed (`loss_memory`); and
    the ring's timeline (what each rank posted and computed, when), gathered from every rank."""
    measured = loss_memory(rt, c, 64, t)
    peaks = {key: measured[key][0] for key in measured if key != "events"}
    sent = {key: measured[key][1] for key in measured if key != "events"}
    for (loss_name, exchange), peak in peaks.items():
        verdict.figure(f"peak MiB {loss_name} {exchange}", peak / 2**20)
    block, n = c * 64 * 4, c * rt.world_size
    table = Table(title=f"Peak MiB per rank, C = {c}, d = 64", title_justify="left")
    for column in ("loss", "gather", "ring", "N x 2d"):
        table.add_column(column, justify="right")
    for loss_name in LOSSES:
        table.add_row(
            loss_name, *(f"{peaks[loss_name, ex] / 2**20:.2f}" for ex in EXCHANGES), f"{2 * n * 64 * 4 / 2**20:.2f}"
        )
    print0(table)
    if rt.world_size > 1:  # the price of the ring's bound: more bytes than the gather sends
        ratio = {loss: sent[loss, "ring"] / sent[loss, "gather"] for loss in LOSSES}
        print0(
            f"The ring's price is bytes: at P = {rt.world_size} each rank sends "
            + " and ".join(f"{ratio[loss]:.2f}x the gather's ({loss})" for loss in LOSSES)
            + "; InfoNCE's ring walks twice. Its peak grows from P = 1 to 3 (a middle step appears: a block "
            "arriving, one in use, an accumulator leaving), then stays under the bound; the gather's grows "
            "by N x 2d per rank with every P.",
            highlight=False,
        )
        verdict.figure("ring bytes / gather bytes", ratio)
    verdict.check(
        "the ring holds at most 10 C x d blocks and 4 tiles, whatever P",
        all(peaks[loss, "ring"] <= 10 * block + 4 * t * t * 4 for loss in LOSSES),
    )
    verdict.check(
        "the gather holds the N x 2d gathered embeddings, growing with P",
        all(peaks[loss, "gather"] >= 2 * n * 64 * 4 for loss in LOSSES),
    )
    every = [None] * rt.world_size
    dist.all_gather_object(every, measured["events"])
    return [event for events in every for event in events]


def timeline_table(events: list, world: int) -> Table:
    """Per step and rank: the block held, and when its tiles ran (ms from the first event)."""
    t0 = min(e[3] for e in events)
    table = Table(title="Ring: block held, tiles (ms)", title_justify="left")
    table.add_column("step")
    for r in range(world):
        table.add_column(f"rank {r}", justify="right")
    for k in range(world):
        cells = []
        for r in range(world):
            begin = next(e for e in events if e[:2] == (r, k) and e[2].startswith("begin"))
            end = next(e for e in events if e[:2] == (r, k) and e[2].startswith("end"))
            cells.append(f"y_{begin[2].split()[-1]} {1e3 * (begin[3] - t0):.1f}-{1e3 * (end[3] - t0):.1f}")
        table.add_row(str(k), *cells)
    return table


def posted_ahead(events: list, world: int) -> bool:
    """Every rank posted step k's block (k < P - 1) before it began the tiles that read it."""

    def when(r, k, prefix):
        return next(e[3] for e in events if e[:2] == (r, k) and e[2].startswith(prefix))

    return all(when(r, k, "post block") <= when(r, k, "begin") for r in range(world) for k in range(world - 1))


def main() -> int:
    args = parse_args()
    with distributed(args.device) as rt:
        verdict, c = Verdict(rt), args.pairs_per_rank
        print0(
            f"[bold]Lesson 26: the sigmoid loss and the ring[/]\nC = {c} pairs per rank, P = {rt.world_size}, "
            f"N = {c * rt.world_size}, B = {args.micro_batch_size}, T = {args.stream_chunk}, "
            f"dropout {args.dropout}, float64, {rt.backend}"
        )
        check_closed_form(verdict, c * rt.world_size, args.seed)
        check_ring_by_hand(verdict, rt, c, args.stream_chunk)
        check_infonce_ring_by_hand(verdict, rt, c, args.stream_chunk)
        check_steps(verdict, rt, args)
        events = measure_memory(verdict, rt, args.memory_pairs, 64)
        print0(timeline_table(events, rt.world_size))
        verdict.check("every rank posted each block before the tiles that read it", posted_ahead(events, rt.world_size))
        verdict.figure("timeline", [list(e) for e in events])
        return verdict.finish(args.json)


if __name__ == "__main__":
    run_main(main)
