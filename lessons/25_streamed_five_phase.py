"""Lesson 25: the streamed five-phase step. The exact CLIP gradient of a global batch of N pairs with
O(N d) memory per rank: `from distributed_clip import distributed_backward, distributed_train_step`.

    torchrun --nproc-per-node 2 lessons/25_streamed_five_phase.py    # any P dividing N = 960 (1, 2, 3, 4, ...)

The idea. With logits S = s Z_x Z_y^T (s = 1/tau, fixed or learned), row/column log-sum-exps a, b and
row/column softmax R_ij = exp(S_ij - a_i), Q_ij = exp(S_ij - b_j):

    L = 1/(2N) sum_i (a_i + b_i - 2 S_ii)
    G_x,i = s/(2N) sum_j (R_ij + Q_ij - 2 delta_ij) z_j^y        (G_y,j: the same sum over i, of z_i^x)
    dL/ds = (1/s) sum_i z_i^x . G_x,i                           (a sum over rows: each rank adds its own)
Nothing needs S itself: a, b come from the online max/sum fold, G from tiles of at most T x T
(T = --stream-chunk); the notebook derives both. Phases 3-4 are GradCache's idea (lesson 24) in closed form.

The mechanism is `streamed_backward` below: phase 1 the local forward (no grad, each micro-batch's random
state saved) and one all-gather of Z_x, Z_y [sync 1]; phase 2 a, b and L over T x T tiles; per micro-batch
phase 3 its G and phase 4 its recompute and VJP, scaled by P since DDP averages and the ranks' VJPs must be
summed; phase 5 DDP's reduction [sync 2], in the last backward only. The library (src/distlab/streamed/
step.py) runs the same phases plus guards that fail alike on every rank, autocast, FSDP2, frozen towers,
a sharded phase 2 and a one-forward regime (B >= C = N / P: each pair runs once, with grad).

Two loops, two functions: the classic one (a DistributedSampler, `distributed_train_step`, fixed TAU) and
the caller-owned one (a learned scale; `distributed_backward`, then the loop clips, steps, clamps s).

On a GPU: the kernel is FlashAttention's idea applied to the contrastive loss. Written in torch, each
T x T tile of S is made in memory and walked by a dozen ops, each a kernel launch reading and writing the
whole tile: launches grow as (C / T)(N / T), seconds of host time per step at N = 65,536. The library's
Triton kernels (config KERNELS, src/distlab/streamed/kernels/) keep the tile in registers instead: one
launch walks every column block for a block of rows, makes each S tile from Z_x, Z_y (d in slices), folds
it into the row LSEs (phase 2) or turns it into R + Q - 2 delta and multiplies it into G (phase 3), and
drops it. `launches_table` counts both, for one rank of P = 8 at d = 1,024, on the meta device (nothing
is computed): the kernels' launches per step are the same at every N, and their bytes are the embeddings,
the normalisers and G, not the tiles. Unlike attention's output for a head of 64-256, G's rows are too wide
for registers at d = 1,024, so the fused product adds into G in memory; KERNELS "triton-mm" instead writes
the coefficients W (bf16) in chunks of rows and lets cuBLAS multiply them: W's bytes and two launches per
chunk, against G's traffic (the table's third path; which wins is measured on a GPU, kernels_gpu.py).

The self-check: `streamed_backward` and each loop's step 1 against a deep copy on the whole batch, plain
autograd, each rank's dropout replayed; `streamed_backward` against `distributed_backward` (float64,
every parameter and the scale); the largest temporary the step made against N x N, C x N and B x N.
Pitfalls avoided: streaming one dimension of S only (T x N still grows with N); no no_sync (an all-reduce
per micro-batch); a recompute drawing new dropout masks (the gradient of another loss than the one reported).

A float32 pitfall this float64 lesson does not meet. Written as above, L's term a_i - S_ii and G's diagonal
coefficient R_ii + Q_ii - 2 each subtract two numbers of about the same size: a_i and S_ii are both about s
(up to 100 for a learned scale), and R_ii, Q_ii both near 1 for a confident model, so float32's 7 digits
leave few for the small difference. The library computes each difference where it is small. The positive's
logit is read from the very tile whose running max it is compared with, so nll_i = a_i - S_ii is
(m_i - S_ii) + log l_i, exactly log l_i when the positive is the row's max; and R_ii + Q_ii - 2 is
expm1(-nll_x,i) + expm1(-nll_y,i), precise however small (src/distlab/streamed/torch_tiles.py, `lse_and_nll` and
`pair_coefficients`). Neither CUDA nor unit-norm embeddings are needed for any of it.
"""

from __future__ import annotations

import copy
import math
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from rich.table import Table
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from distlab.comm import compat
from distlab.contrastive.gather import all_gather_blocks
from distlab.contrastive.reference import RankStreams, as_ranks, full_batch_gradients
from distlab.contrastive.report import memory_account_table
from distlab.pieces.chunks import chunks
from distlab.pieces.online_softmax import online_fold
from distlab.pieces.random_state import RandContext
from distlab.processes.console import print0
from distlab.processes.flags import fraction, p_divides_n, positive_float, positive_int, require
from distlab.processes.runtime import distributed, run_main
from distlab.proof.cli import add_contrastive_args, lesson_parser
from distlab.proof.compare import DTYPES, all_ok, compare, comparison_table, grads_of, tolerances
from distlab.proof.memory import PeakMemory
from distlab.proof.models import TwoTower, paired_data
from distlab.proof.verdict import Verdict
from distlab.streamed.config import StreamConfig, parse_config, regime
from distlab.streamed.rank_work import count_rank
from distributed_clip import distributed_backward, distributed_train_step


def parse_args():
    parser = lesson_parser(__doc__)
    add_contrastive_args(parser, global_batch=960)
    parser.add_argument("--micro-batch-size", type=positive_int, default=96, help="B (need not divide N / P)")
    parser.add_argument("--stream-chunk", type=positive_int, default=128, help="T: tiles are at most T x T")
    parser.add_argument("--normalisers", choices=("sharded", "replicated"), default="sharded", help="library's phase 2")
    parser.add_argument("--dataset-size", type=positive_int, default=3840, help="training pairs")
    parser.add_argument("--epochs", type=positive_int, default=2, help="epochs of each loop")
    parser.add_argument("--lr", type=positive_float, default=3e-3, help="AdamW learning rate")
    parser.add_argument("--max-grad-norm", type=positive_float, default=1.0, help="clip_grad_norm_ (caller-owned loop)")
    parser.add_argument("--dropout", type=fraction, default=0.1, help="dropout in both towers")
    parser.add_argument("--dtype", choices=DTYPES, default="float64", help="dtype of weights and data")
    return parser.parse_args()


class ScaledTwoTower(TwoTower):
    """TwoTower that learns its logit scale, open_clip's way: forward returns (z_x, z_y, exp(logit_scale))."""

    def __init__(self, tau: float, **kwargs):
        super().__init__(**kwargs)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / tau), dtype=kwargs["dtype"]))

    def forward(self, x, y):
        return (*super().forward(x, y), self.logit_scale.exp())


# ---- the mechanism: the log-normalisers and G in tiles, the five phases --------------------------


def lse_by_tiles(q: torch.Tensor, k: torch.Tensor, s: float, t: int) -> torch.Tensor:
    """log sum_j exp(s q_i . k_j) for every row i of q, one tile of at most T x T at a time."""
    lse = q.new_empty(len(q))
    for rows in chunks(len(q), t):
        run_max = q.new_full((rows.stop - rows.start,), -math.inf)  # m_i, the running max
        run_sum = torch.zeros_like(run_max)  # l_i = sum_j exp(S_ij - m_i)
        for cols in chunks(len(k), t):
            tile = s * q[rows] @ k[cols].T  # a T x T tile of S
            run_max, run_sum = online_fold(run_max, run_sum, tile, dim=1)
        lse[rows] = run_max + run_sum.log()  # a_i = m_i + log l_i
    return lse


def grad_by_tiles(
    q: torch.Tensor, k: torch.Tensor, lse_q: torch.Tensor, lse_k: torch.Tensor, s: float, t: int, offset: int
) -> torch.Tensor:
    """sum_j (R_ij + Q_ij - 2 delta_ij) k_j for the rows i of q (global rows offset, offset + 1, ...),
    with R_ij = exp(S_ij - lse_q_i), Q_ij = exp(S_ij - lse_k_j): tile by tile, never a row of S."""
    out = torch.zeros_like(q)  # |q| x d
    for rows in chunks(len(q), t):
        for cols in chunks(len(k), t):
            tile = s * q[rows] @ k[cols].T  # S, at most T x T
            i = torch.arange(rows.start, rows.stop, device=q.device)[:, None] + offset  # global rows
            j = torch.arange(cols.start, cols.stop, device=q.device)  # and columns
            # R_ij + Q_ij - 2 delta_ij: delta_ij = 1 where row i meets its positive, column j = i
            coef = (tile - lse_q[rows, None]).exp() + (tile - lse_k[cols]).exp() - 2 * (i == j).to(q.dtype)
            out[rows] += coef @ k[cols]  # T x d
    return out


def streamed_backward(
    ddp: DDP, local_x: torch.Tensor, local_y: torch.Tensor, cfg: StreamConfig, tau: float | None
) -> float:
    """The five phases: add the exact gradient of the global loss into .grad (like loss.backward());
    return L. tau None: the model returns its logit scale s third, and s gets its gradient too."""
    n, world, micro = cfg.n, cfg.world, cfg.micro
    # Phase 1: the local forward, no grad, in micro-batches of at most B, each one's random state saved.
    states, outs = [], []
    with torch.no_grad():
        for rows in micro:
            states.append(RandContext(local_x[rows], local_y[rows]))
            outs.append(ddp.module(local_x[rows], local_y[rows]))
    mine = torch.cat([torch.cat(out[:2], dim=1) for out in outs])  # C x 2d: z_x | z_y
    every = mine.new_empty((n, mine.shape[1]))  # N x 2d
    compat.all_gather_single(every, mine)  # sync 1: every rank's rows
    z_x, z_y = every.chunk(2, dim=1)  # N x d each
    s = 1 / tau if tau is not None else outs[0][2].item()
    # Phase 2: a_i = log sum_j exp S_ij, b_j = log sum_i exp S_ij (the rows of S^T), T x T tiles.
    a, b = lse_by_tiles(z_x, z_y, s, cfg.t), lse_by_tiles(z_y, z_x, s, cfg.t)  # N, N
    # L = 1/(2N) sum_i (a_i + b_i - 2 S_ii),  S_ii = s z_i^x . z_i^y
    loss = (a + b - 2 * s * (z_x * z_y).sum(1)).sum() / (2 * n)
    for k, rows in enumerate(micro):
        glob = slice(cfg.offset + rows.start, cfg.offset + rows.stop)  # this micro-batch's global rows
        # Phase 3: G_x,i = s/(2N) sum_j (R_ij + Q_ij - 2 delta_ij) z_j^y; G_y the same with S^T (B x d)
        g_x = s / (2 * n) * grad_by_tiles(z_x[glob], z_y, a[glob], b, s, cfg.t, glob.start)
        g_y = s / (2 * n) * grad_by_tiles(z_y[glob], z_x, b[glob], a, s, cfg.t, glob.start)
        # dL/ds = (1/s) sum_i z_i^x . G_x,i over these rows (DDP's reduction sums the ranks' shares)
        g_s = (z_x[glob] * g_x).sum() / s
        # Phase 5: DDP reduces the gradients in the last micro-batch's backward only (sync 2).
        with ddp.no_sync() if k < len(micro) - 1 else nullcontext():
            with states[k]:  # the same dropout masks
                out = ddp(local_x[rows], local_y[rows])  # the recompute, with grad
            # Phase 4: the VJP of P <(z_x, z_y, s), (G_x, G_y, dL/ds)>: DDP averages, the gradient sums.
            torch.autograd.backward(out, [world * g for g in (g_x, g_y, g_s)[: len(out)]])
    return loss.item()


# ---- the chapter, part by part -------------------------------------------------------------------


def classic_loop(ddp, optimizer, loader, config, rt, memory: PeakMemory) -> tuple[list, dict]:
    """The classic loop: sampler epochs, one `distributed_train_step` per batch, rank 0 logs."""
    losses, first = [], {}
    for epoch in range(loader.epochs):
        loader.sampler.set_epoch(epoch)
        for batch_idx, (local_x, local_y) in enumerate(loader):
            local_x, local_y = local_x.to(rt.device), local_y.to(rt.device)
            with memory if not losses else nullcontext():  # measure step 1
                loss = distributed_train_step(ddp, optimizer, local_x, local_y, config)
            first = first or grads_of(ddp.module)
            losses.append(loss)
            print0(f"Epoch {epoch}, Step {batch_idx}, Loss: {loss:.4f}")
    return losses, first


def caller_owned_loop(ddp, optimizer, loader, config, rt, max_norm: float) -> tuple[list, dict]:
    """The loop a CLIP trainer writes: it owns zero_grad, clipping, the step and the scale's clamp."""
    losses, first = [], {}
    for epoch in range(loader.epochs):
        loader.sampler.set_epoch(epoch)
        for local_x, local_y in loader:
            optimizer.zero_grad(set_to_none=True)
            loss = distributed_backward(ddp, local_x.to(rt.device), local_y.to(rt.device), config)
            first = first or grads_of(ddp.module)
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), max_norm)
            optimizer.step()
            with torch.no_grad():  # open_clip clamps s to at most 100 (tau >= 0.01)
                ddp.module.logit_scale.clamp_(0, math.log(100))
            losses.append(loss)
        print0(f"Epoch {epoch}, loss {loss:.4f}, learned tau {1 / ddp.module.logit_scale.exp().item():.4f}")
    return losses, first


@dataclass(frozen=True)
class Run:
    """What the checks and both loops share."""

    args: Any
    rt: Any
    cfg: StreamConfig
    config: dict  # the library's config, without TAU
    loader: DataLoader
    first: tuple  # step 1's global batch (x, y), rank 0's share first


def prepare(args, rt) -> Run:
    n, world = args.global_batch, rt.world_size
    p_divides_n(n, world)
    require(args.dataset_size >= n, "--dataset-size", f"must hold at least one global batch (N={n})")
    config = {
        "GLOBAL_BATCH_SIZE": n,
        "MICRO_BATCH_SIZE": args.micro_batch_size,
        "STREAM_CHUNK_SIZE": args.stream_chunk,
        "NORMALISERS": args.normalisers,
    }
    cfg = parse_config(config, world, rt.rank)
    dataset = TensorDataset(*paired_data(args.dataset_size, seed=args.seed, dtype=DTYPES[args.dtype]))
    sampler = DistributedSampler(dataset, world, rt.rank, shuffle=True, seed=args.seed, drop_last=True)
    # A private generator: the loader must not draw from the global stream dropout uses.
    loader = DataLoader(
        dataset,
        batch_size=cfg.local,
        sampler=sampler,
        drop_last=True,
        generator=torch.Generator().manual_seed(args.seed),
    )
    loader.epochs = args.epochs
    first = tuple(all_gather_blocks(t.to(rt.device)) for t in next(iter(loader)))  # step 1's global batch
    return Run(args, rt, cfg, config, loader, first)


def start_ddp(run: Run, model: nn.Module) -> tuple[DDP, torch.optim.Optimizer]:
    ddp = DDP(model.to(run.rt.device), device_ids=[run.rt.local_rank] if run.rt.device.type == "cuda" else None)
    torch.manual_seed(run.args.seed + 1000 + run.rt.rank)  # each rank its own dropout stream, as in DDP
    return ddp, torch.optim.AdamW(ddp.parameters(), lr=run.args.lr)


def reference(run: Run, model: nn.Module, s: float | None) -> tuple[float, dict]:
    """Plain autograd on the whole global batch in one process (a deep copy), each rank's pairs in its
    micro-batches (cut as the step cuts them) from its own random stream: the same dropout masks."""
    streams = RankStreams([run.args.seed + 1000 + r for r in range(run.rt.world_size)])
    return full_batch_gradients(model, *run.first, s, forward=as_ranks(streams, run.cfg.micro))


def check_step_one(verdict, name, got: dict, ref: tuple[float, dict], losses: list[float], dtype) -> None:
    """Step 1's gradients and loss against the reference; with a loop's losses, that they went down."""
    (ref_loss, ref_grads), (rtol, atol), loss = ref, tolerances(dtype), losses[0]
    rows = compare(ref_grads, got)
    print0(
        comparison_table(
            rows,
            f"{name}: step 1 vs single-process full batch",
            caption=f"rank 0; allclose with rtol {rtol:g}, atol {atol:g}; loss {loss:.12f} vs {ref_loss:.12f}",
        )
    )
    verdict.figure(f"{name} max relative error", max(r.max_rel for r in rows))
    verdict.check(
        f"{name}: step 1's gradients and loss equal the full batch's",
        all_ok(rows) and abs(loss - ref_loss) <= atol + rtol * abs(ref_loss),
    )
    if len(losses) > 1:
        verdict.check(f"{name}: the loss went down ({loss:.3f} -> {losses[-1]:.3f})", losses[-1] < loss)


def check_mechanism(run: Run, verdict: Verdict) -> None:
    """`streamed_backward` against `distributed_backward` and the full batch: step 1, a learned scale."""
    dtype, mine = DTYPES[run.args.dtype], slice(run.cfg.offset, run.cfg.offset + run.cfg.local)
    start = ScaledTwoTower(run.args.tau, dropout=run.args.dropout, seed=run.args.seed, dtype=dtype)
    x, y, got = run.first[0][mine], run.first[1][mine], {}
    for name, step in (
        ("lesson", lambda ddp: streamed_backward(ddp, x, y, run.cfg, None)),
        ("library", lambda ddp: distributed_backward(ddp, x, y, run.config)),
    ):
        ddp, _ = start_ddp(run, copy.deepcopy(start))
        got[name] = step(ddp), grads_of(ddp.module)
    rows, rtol = compare(got["library"][1], got["lesson"][1]), tolerances(dtype)[0]
    worst = verdict.figure("lesson vs library max relative error", max(r.max_rel for r in rows))
    print0(f"\nstreamed_backward vs distributed_backward, {len(rows)} tensors: largest relative gap {worst:.1e}")
    verdict.check(
        "streamed_backward equals distributed_backward (every parameter, the scale, the loss)",
        all_ok(rows) and math.isclose(got["lesson"][0], got["library"][0], rel_tol=rtol),
    )
    check_step_one(
        verdict, "streamed_backward", got["lesson"][1], reference(run, start, None), [got["lesson"][0]], dtype
    )


def run_classic(run: Run, verdict: Verdict) -> None:
    """Loop 1: fixed tau, `distributed_train_step`; step 1 checked, its memory accounted."""
    args, dtype, mem = run.args, DTYPES[run.args.dtype], PeakMemory(run.rt.device)
    model = TwoTower(dropout=args.dropout, seed=args.seed, dtype=dtype)
    ref = reference(run, model, 1 / args.tau)
    print0("\n[bold]loop 1, fixed tau[/]: distributed_train_step")
    losses, first = classic_loop(*start_ddp(run, model), run.loader, run.config | {"TAU": args.tau}, run.rt, mem)
    check_step_one(verdict, "loop 1, fixed tau", first, ref, losses, dtype)
    n, d, itemsize = run.cfg.n, model.encoder_x[-1].out_features, torch.empty((), dtype=dtype).element_size()
    print0(memory_account_table(mem.largest_bytes, mem.peak_bytes, n, d, run.cfg, itemsize, mem.allocator_peak_bytes))
    tile = min(run.cfg.t, n) ** 2  # phase 2's tiles and phase 3's are at most T x T
    verdict.check(
        "the largest temporary is no bigger than the gathered embeddings or one tile",
        mem.largest_bytes <= max(n * 2 * d, tile) * itemsize,
    )


def run_caller_owned(run: Run, verdict: Verdict) -> None:
    """Loop 2: a learned scale, `distributed_backward`, clipping and the clamp in the caller's hands."""
    args, dtype = run.args, DTYPES[run.args.dtype]
    model = ScaledTwoTower(args.tau, dropout=args.dropout, seed=args.seed, dtype=dtype)
    ref = reference(run, model, None)
    print0("\n[bold]loop 2, learned s[/]: distributed_backward, clip_grad_norm_, step")
    losses, first = caller_owned_loop(*start_ddp(run, model), run.loader, run.config, run.rt, args.max_grad_norm)
    check_step_one(verdict, "loop 2, learned s", first, ref, losses, dtype)
    print0(f"learned temperature after {len(losses)} steps: tau = {1 / model.logit_scale.exp().item():.4f}")
    verdict.figure("learned tau", 1 / model.logit_scale.exp().item())


PATHS = {"torch": "torch tiles, float32", "triton": "Triton kernels, bf16", "triton-mm": "W in memory, bf16"}


def launches_table(verdict: Verdict) -> None:
    """Launches and bytes per step of one rank (P = 8, d = 1,024, T = 1,024), the torch tiles against the
    fused kernels and W in memory, counted on the meta device at two N (`distlab.streamed.rank_work.count_rank`)."""
    table = Table(title="one rank's step, P = 8, d = 1024, T = 1024 (counted, not run)", title_justify="left")
    for column in ("N", "path", "launches", "GiB read + written"):
        table.add_column(column, justify="left" if column == "path" else "right")
    counts = {}
    for n in (4096, 16384):
        for kernels, name in PATHS.items():
            precision, dtype = ("float32", torch.float32) if kernels == "torch" else ("bf16", torch.bfloat16)
            keys = {"GLOBAL_BATCH_SIZE": n, "MICRO_BATCH_SIZE": n // 8, "STREAM_CHUNK_SIZE": 1024, "TAU": 0.07}
            cfg = parse_config(keys | {"KERNELS": kernels, "MATMUL_PRECISION": precision}, 8, 0)
            count = counts[n, kernels] = count_rank(cfg, "infonce", 1024, dtype)
            table.add_row(f"{n:,}", name, f"{count.launches:,}", f"{count.moved_bytes / 2**30:.2f}")
    print0(table)
    verdict.check(
        "the fused kernels launch as many kernels per step at N = 16,384 as at 4,096 (the torch tiles: more)",
        counts[4096, "triton"].launches == counts[16384, "triton"].launches
        and counts[16384, "torch"].launches > counts[4096, "torch"].launches,
    )


def main() -> int:
    args = parse_args()
    with distributed(args.device) as rt:
        verdict, run = Verdict(rt), prepare(args, rt)
        cfg = run.cfg
        print0(
            f"[bold]Lesson 25: the streamed five-phase step[/]\nN={cfg.n} over P={cfg.world}, B={cfg.b}, "
            f"T={cfg.t}, tau={args.tau}, normalisers {cfg.normalisers}, dropout {args.dropout}, "
            f"{args.dtype}, {rt.backend}\nregime: {regime(cfg)}"
        )
        check_mechanism(run, verdict)
        run_classic(run, verdict)
        run_caller_owned(run, verdict)
        launches_table(verdict)
        return verdict.finish(args.json)


if __name__ == "__main__":
    run_main(main)
