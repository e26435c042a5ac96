"""Lesson 14: the streamed five-phase step. The exact CLIP gradient of a global batch of N pairs with
O(N d) memory per rank: `from distributed_clip import distributed_backward, distributed_train_step`.

    torchrun --nproc-per-node 2 lessons/14_streamed_five_phase.py    # any P dividing N = 960 (1, 2, 3, 4, ...)

The idea. With logits S = s Z_x Z_y^T (s = 1/tau, fixed or learned), row/column log-sum-exps a, b,
row/column softmax R_ij = exp(S_ij - a_i), Q_ij = exp(S_ij - b_j) and W = R + Q - 2I:

    L = 1/(2N) sum_i (a_i + b_i - 2 S_ii)       G_x = s/(2N) W Z_y       G_y = s/(2N) W^T Z_x
    dL/ds = (1/s) sum_i z_i^x . G_x,i           (a sum over rows: each rank adds its own)

Nothing needs S itself, only a, b (streamed by the online max/sum fold) and products W Z summed over
tiles of at most T x T (T = --stream-chunk). The notebook derives both, each step checked numerically. It builds
on lesson 12 (each rank only its own rows of S) and lesson 13: phases C and D are GradCache's idea
(luyug/GradCache; Gao et al., https://arxiv.org/abs/2101.06983: gradients at the embeddings first, then
one VJP per micro-batch), with the cached loss replaced by closed forms.

The mechanism: src/distlab/contrastive/streamed.py, `_run`, which reads top to bottom: a tiny
exchange of the config and batch sizes (`streamed_checks.agree_before_forward`), A the local forward
(`phase_a_forward`), a second one of what the forward returned
(`streamed_checks.agree_across_ranks`: every rank checks both the same way, so bad input is one
error everywhere), the all-gather of Z_x, Z_y (`phase_a_gather`, sync 1); B the normalisers in T x T
tiles (`phase_b_normalisers`); per micro-batch C its G (`phase_c_embedding_grads`) and D its VJP
(`phase_d_backward`), where E, the wrapper's reduction (sync 2), runs in the last backward. D
back-propagates m G with m = P under DDP: G is the gradient of the global loss, so the ranks' VJPs
must be summed, and DDP averages (lesson 06). The tile math is in streamed_kernels.py
(`online_fold`, `streamed_softmax_pair_product`).

Two regimes. B >= C (C = N / P): one forward; the rank's pairs run once, with grad, and D back-propagates
into that graph (1 forward per pair; all C pairs' activations held from A to D, as in plain DDP).
B < C: recompute; A runs without grad, D again with grad under the saved random state (2 forwards per
pair; one micro-batch's activations at a time). The lesson prints which one its flags chose.

Two loops. First the classic one: a DistributedSampler, set_epoch, `distributed_train_step` with a
fixed TAU, rank 0 logging. Then the caller-owned one with a learnable scale: `distributed_backward`
fills .grad, the loop clips, steps and clamps s as open_clip does (https://github.com/mlfoundations/open_clip).

The self-check. Step 1 of each loop against a deep copy trained on the whole global batch in one
process with plain autograd (each rank's dropout masks replayed in its micro-batches), and a memory
account: the largest temporary the step made against N x N, C x N and B x N.

Pitfalls a first version of this step meets, all avoided here: streaming only one dimension of S
(T x N slices still grow with N); calling backward per micro-batch under DDP without no_sync (one
all-reduce per micro-batch instead of one); a recompute that draws new dropout masks (the gradient of
a different loss than the one reported); computing a_i - S_ii and R_ii + Q_ii - 2 as written (two
numbers of size s cancel in float32). Neither CUDA nor unit-norm embeddings are needed.
"""

from __future__ import annotations

import copy
import math
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from rich.table import Table
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from distlab.cli import DTYPES, fraction, lesson_parser, positive_float, positive_int, require
from distlab.compare import all_ok, compare, comparison_table, grads_of, tolerances
from distlab.console import print0
from distlab.streamed.config import parse_config, regime
from distlab.chunks import balanced_chunks
from distlab.memory import PeakMemory
from distlab.models import TwoTower, paired_data
from distlab.runtime import distributed, run_main
from distlab.verdict import Verdict
from distributed_clip import distributed_backward, distributed_train_step


def parse_args():
    parser = lesson_parser(__doc__)
    parser.add_argument("--global-batch", type=positive_int, default=960, help="N, split over the ranks (P must divide it)")
    parser.add_argument("--micro-batch-size", type=positive_int, default=96, help="B (need not divide N / P)")
    parser.add_argument("--stream-chunk", type=positive_int, default=128, help="T: tiles are at most T x T")
    parser.add_argument("--tau", type=positive_float, default=0.1, help="temperature of the first loop; "
                        "the second learns s = 1/tau starting from it")
    parser.add_argument("--normalisers", choices=("sharded", "replicated"), default="sharded",
                        help="Phase B: each rank its own rows and columns of S, or every rank all of it")
    parser.add_argument("--dataset-size", type=positive_int, default=3840, help="training pairs")
    parser.add_argument("--epochs", type=positive_int, default=2, help="epochs of each loop")
    parser.add_argument("--lr", type=positive_float, default=3e-3, help="AdamW learning rate")
    parser.add_argument("--max-grad-norm", type=positive_float, default=1.0, help="clip_grad_norm_ (loop 2)")
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


def first_global_batch(dataset, world: int, local: int, seed: int, epoch: int = 0) -> torch.Tensor:
    """Step 1's global batch, rank 0's share first: every rank rebuilds every rank's sampler."""
    indices = []
    for r in range(world):
        sampler = DistributedSampler(dataset, world, r, shuffle=True, seed=seed, drop_last=True)
        sampler.set_epoch(epoch)
        indices += list(sampler)[:local]
    return torch.tensor(indices)


def full_batch_reference(model: nn.Module, x, y, world: int, micro: int, tau: float | None,
                         dropout_seed: int) -> tuple[dict, float]:
    """Plain autograd on the whole global batch in one process, the symmetric InfoNCE written out.
    Rank r's pairs go through in its micro-batches, in order, from rank r's random stream: the
    dropout masks the step says it used (one forward of C rows when B >= C)."""
    model, local, outs = copy.deepcopy(model), len(x) // world, []
    with torch.random.fork_rng():
        for r in range(world):
            torch.manual_seed(dropout_seed + r)
            rows = slice(r * local, (r + 1) * local)
            outs += [model(x[rows][s], y[rows][s]) for s in balanced_chunks(local, min(micro, local))]
    z_x, z_y = (torch.cat([o[i] for o in outs]) for i in (0, 1))
    logits = (outs[0][2] if tau is None else 1 / tau) * z_x @ z_y.T
    labels = torch.arange(len(x), device=x.device)
    loss = (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2
    loss.backward()
    return grads_of(model), loss.item()


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


def memory_table(mem: PeakMemory, n: int, d: int, cfg, itemsize: int) -> Table:
    table = Table(title="Memory account of step 1 (this rank, tensor storage the step allocated)",
                  title_justify="left")
    for column, justify in (("what", "left"), ("bytes", "right"), ("vs N x N", "right")):
        table.add_column(column, justify=justify)
    b, t, full = min(cfg.b, cfg.local), min(cfg.t, n), n * n * itemsize
    for label, nbytes in (("largest temporary the step made", mem.largest_bytes),
                          ("peak of everything the step held at once", mem.peak_bytes),
                          (f"gathered Z_x | Z_y (N x 2d = {n} x {2 * d})", n * 2 * d * itemsize),
                          (f"one tile, T x T ({t} x {t})", t * t * itemsize),
                          (f"B x N ({b} x {n}): never made", b * n * itemsize),
                          (f"C x N ({cfg.local} x {n}), lesson 12's logits", cfg.local * n * itemsize),
                          (f"N x N ({n} x {n}), lesson 10's logits", full)):
        table.add_row(label, f"{nbytes:,}", f"{nbytes / full:.4f}")
    return table


def check_step_one(verdict, name, got: dict, ref: tuple[dict, float], loss: float, dtype) -> None:
    rows, (ref_grads, ref_loss) = compare(ref[0], got), ref
    rtol, atol = tolerances(dtype)
    print0(comparison_table(rows, f"{name}: step 1 vs single-process full batch",
                            caption=f"rank 0; allclose with rtol {rtol:g}, atol {atol:g}; loss "
                                    f"{loss:.12f} vs {ref_loss:.12f}"))
    verdict.figure(f"{name} max relative error", max(r.max_rel for r in rows))
    verdict.check(f"{name}: step 1's gradients and loss equal the full batch's",
                  all_ok(rows) and abs(loss - ref_loss) <= atol + rtol * abs(ref_loss))


def main() -> int:
    args = parse_args()
    dtype = DTYPES[args.dtype]
    with distributed(args.device) as rt:
        n, world, verdict = args.global_batch, rt.world_size, Verdict(rt)
        require(n % world == 0, "--global-batch", f"N={n} must be divisible by the world size P={world}")
        require(args.dataset_size >= n, "--dataset-size", f"must hold at least one global batch (N={n})")
        config = {"GLOBAL_BATCH_SIZE": n, "MICRO_BATCH_SIZE": args.micro_batch_size,
                  "STREAM_CHUNK_SIZE": args.stream_chunk, "NORMALISERS": args.normalisers}
        cfg = parse_config(config, world, rt.rank)
        print0(f"[bold]Lesson 14: the streamed five-phase step[/]\nN={n} over P={world}, B={cfg.b}, T={cfg.t}, "
               f"tau={args.tau}, normalisers {cfg.normalisers}, dropout {args.dropout}, {args.dtype}, {rt.backend}\n"
               f"regime: {regime(cfg)}")
        x, y = paired_data(args.dataset_size, seed=args.seed, dtype=dtype)
        dataset = TensorDataset(x, y)
        sampler = DistributedSampler(dataset, world, rt.rank, shuffle=True, seed=args.seed, drop_last=True)
        # A private generator: the loader must not draw from the global stream dropout uses.
        loader = DataLoader(dataset, batch_size=cfg.local, sampler=sampler, drop_last=True,
                            generator=torch.Generator().manual_seed(args.seed))
        loader.epochs = args.epochs
        idx = first_global_batch(dataset, world, cfg.local, args.seed)
        first_x, first_y, mem = x[idx].to(rt.device), y[idx].to(rt.device), PeakMemory()
        for name, model in (("loop 1, fixed tau", TwoTower(dropout=args.dropout, seed=args.seed, dtype=dtype)),
                            ("loop 2, learned s", ScaledTwoTower(args.tau, dropout=args.dropout, seed=args.seed,
                                                                 dtype=dtype))):
            learnable, start = name.startswith("loop 2"), copy.deepcopy(model)
            ddp = DDP(model.to(rt.device), device_ids=[rt.local_rank] if rt.device.type == "cuda" else None)
            optimizer = torch.optim.AdamW(ddp.parameters(), lr=args.lr)
            torch.manual_seed(args.seed + 1000 + rt.rank)  # each rank its own dropout stream, as in DDP
            print0(f"\n[bold]{name}[/]: " + ("distributed_backward, clip_grad_norm_, step" if learnable
                                              else "distributed_train_step"))
            step_config = config if learnable else config | {"TAU": args.tau}
            losses, first = (caller_owned_loop(ddp, optimizer, loader, step_config, rt, args.max_grad_norm)
                             if learnable else classic_loop(ddp, optimizer, loader, step_config, rt, mem))
            ref = full_batch_reference(start, first_x, first_y, world, cfg.b, None if learnable else args.tau,
                                       args.seed + 1000)
            check_step_one(verdict, name, first, ref, losses[0], dtype)
            verdict.check(f"{name}: the loss went down ({losses[0]:.3f} -> {losses[-1]:.3f})", losses[-1] < losses[0])
        d, itemsize = model.encoder_x[-1].out_features, torch.empty((), dtype=dtype).element_size()
        print0(memory_table(mem, n, d, cfg, itemsize))
        tile = min(cfg.t, n) * min(cfg.t, n)  # Phase B's T x T; Phase C's rows are blocked at T
        verdict.check("the largest temporary is no bigger than the gathered embeddings or one tile",
                      mem.largest_bytes <= max(n * 2 * d, tile) * itemsize)
        print0(f"learned temperature after {len(losses)} steps: tau = {1 / model.logit_scale.exp().item():.4f}")
        verdict.figure("learned tau", 1 / model.logit_scale.exp().item())
        return verdict.finish(args.json)


if __name__ == "__main__":
    run_main(main)
