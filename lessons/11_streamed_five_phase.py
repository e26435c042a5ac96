"""Lesson 11: the streamed five-phase step. Exact CLIP gradients over a global batch N with O(N*d)
memory per rank instead of O(N^2): `from distributed_clip import distributed_train_step`.

    torchrun --nproc-per-node 2 lessons/11_streamed_five_phase.py      # any P dividing the batch

The idea. The symmetric InfoNCE over N pairs needs, for its gradient, only the embeddings and two
vectors of log-normalisers. With S = Z_x Z_y^T / tau, a = row LSE(S), b = column LSE(S):

    L   = 1/(2N) sum_i (a_i + b_i - 2 S_ii)
    G_x = dL/dZ_x = (P Z_y + Q Z_y - 2 Z_y) / (2 N tau),   P = exp(S - a 1^T),  Q = exp(S - 1 b^T)
    G_y = dL/dZ_y = (P^T Z_x + Q^T Z_x - 2 Z_x) / (2 N tau)

so the step never needs S itself. A: embed the local C = N / P pairs without grad, in micro-batches of
B, saving each one's RNG state; all-gather Z_x, Z_y (sync 1). B: stream a and b over tiles of at most
M x M (each rank its own rows and columns, then a tiny all-gather of 2N floats; or every rank all of
S). C: per micro-batch, G from the closed forms, streamed over the global dimension in B x M tiles.
D: recompute the micro-batch with grad (same dropout masks) and back-propagate P * <Z', G>. E: DDP's
one all-reduce, in the last micro-batch's backward (all others under no_sync; sync 2); step.

The training loop is the seed's: a DistributedSampler, set_epoch each epoch, rank 0 logs.

The self-check. Step 1's global gradient and loss against a deep copy of the model trained on the
whole global batch in one process with plain autograd on `clip_loss` (the dropout masks are drawn
from each rank's random stream in the same order, so the copy sees the masks the step says it used);
and a memory account: the largest temporary the step made, against N x N, C x N and B x N.

What seeds 000/001 got wrong or left open: Phase B's S_{R,:} slices are M x N, so only one dimension
was streamed (here both); "M" names both the micro-batch and the chunk (here B and M); per micro-batch
backward under DDP all-reduces every micro-batch unless all but the last run under no_sync (the seed's
"two sync points" need it); dropout is not replayed (here RandContext); P_ii + Q_ii - 2 and a_i - S_ii
cancel two numbers of size 1/tau in float32 (here they come from -log P_ii computed in place); and
neither CUDA nor unit-norm embeddings are needed (gloo on CPU works; the gradient is exact for any Z).
"""

from __future__ import annotations

import argparse
import copy
from contextlib import nullcontext

import torch
import torch.distributed as dist
from rich.table import Table
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from distlab.cli import DTYPES
from distlab.compare import all_ok, compare, comparison_table, grads_of, tolerances
from distlab.contrastive.losses import clip_loss
from distlab.contrastive.streamed import chunks
from distlab.memory import PeakMemory
from distlab.models import TwoTower, paired_data
from distlab.runtime import add_runtime_args, all_ranks_true, distributed, print0, run_main
from distributed_clip import distributed_train_step


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--global-batch", type=int, default=1024, help="N, split over the ranks")
    parser.add_argument("--micro-batch", type=int, default=96, help="B (need not divide N / P)")
    parser.add_argument("--chunk", type=int, default=128, help="M, the stream chunk")
    parser.add_argument("--tau", type=float, default=0.1)
    parser.add_argument("--phase-b", choices=("sharded", "replicated"), default="sharded")
    parser.add_argument("--dataset-size", type=int, default=4096)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--dtype", choices=DTYPES, default="float64")
    return add_runtime_args(parser).parse_args()


def global_first_batch(dataset: TensorDataset, world: int, local: int, seed: int) -> torch.Tensor:
    """The indices of step 1's global batch, rank 0's share first: every rank can rebuild every
    rank's DistributedSampler, so the reference needs no communication."""
    indices = []
    for r in range(world):
        sampler = DistributedSampler(dataset, world, r, shuffle=True, seed=seed, drop_last=True)
        sampler.set_epoch(0)
        indices += list(sampler)[:local]
    return torch.tensor(indices)


def reference_first_step(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, world: int,
                         micro: int, tau: float, dropout_seed: int) -> tuple[dict, float]:
    """Plain autograd on the whole global batch in one process. Rank r's pairs go through in its
    micro-batches, in order, from rank r's random stream: the dropout masks the step claims to use."""
    model = copy.deepcopy(model)
    local, parts = len(x) // world, []
    with torch.random.fork_rng():
        for r in range(world):
            torch.manual_seed(dropout_seed + r)
            parts += [model(x[r * local:][s], y[r * local:][s]) for s in chunks(local, micro)]
    loss = clip_loss(torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]), tau)
    loss.backward()
    return grads_of(model), loss.item()


@torch.no_grad()
def retrieval_accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Top-1: how often x_i's nearest y (by cosine) is y_i, on held-out pairs."""
    was_training = model.training
    model.eval()
    z_x, z_y = model(x, y)
    model.train(was_training)
    return (z_x @ z_y.T).argmax(1).eq(torch.arange(len(x), device=x.device)).float().mean().item()


def memory_table(mem: PeakMemory, n: int, d: int, local: int, micro: int, chunk: int,
                 itemsize: int) -> Table:
    table = Table(title="Memory account of step 1 (this rank, tensor storage the step allocated)",
                  title_justify="left")
    table.add_column("what")
    table.add_column("bytes", justify="right")
    table.add_column("vs N x N", justify="right")
    full = n * n * itemsize
    for label, nbytes in (("largest temporary the step made", mem.largest_bytes),
                          ("peak of everything the step held at once", mem.peak_bytes),
                          (f"gathered Z_x | Z_y (N x 2d = {n} x {2 * d})", n * 2 * d * itemsize),
                          (f"one B x M tile ({min(micro, local)} x {min(chunk, n)})",
                           min(micro, local) * min(chunk, n) * itemsize),
                          (f"B x N ({micro} x {n}): never made", micro * n * itemsize),
                          (f"C x N ({local} x {n}), lesson 09's logits", local * n * itemsize),
                          (f"N x N ({n} x {n}), lesson 07's logits", full)):
        table.add_row(label, f"{nbytes:,}", f"{nbytes / full:.4f}")
    return table


def main() -> int:
    args = parse_args()
    dtype = DTYPES[args.dtype]
    with distributed(args.device) as rt:
        n, world = args.global_batch, rt.world_size
        local = n // world
        print0(f"[bold]Lesson 11: the streamed five-phase step[/] - N={n} over {world} rank(s), "
               f"B={args.micro_batch}, M={args.chunk}, tau={args.tau}, Phase B {args.phase_b}, "
               f"dropout {args.dropout}, backend {rt.backend}, {args.dtype}")
        x, y = paired_data(args.dataset_size, seed=args.seed, dtype=dtype)
        dataset = TensorDataset(x, y)
        sampler = DistributedSampler(dataset, world, rt.rank, shuffle=True, seed=args.seed, drop_last=True)
        # A private generator: the loader must not draw from the global stream dropout uses.
        loader = DataLoader(dataset, batch_size=local, sampler=sampler, drop_last=True,
                            generator=torch.Generator().manual_seed(args.seed))
        model = TwoTower(dropout=args.dropout, seed=args.seed, dtype=dtype).to(rt.device)
        reference_model = copy.deepcopy(model)
        ddp = DDP(model, device_ids=[rt.local_rank] if rt.device.type == "cuda" else None)
        optimizer = torch.optim.AdamW(ddp.parameters(), lr=args.lr)
        config = {"GLOBAL_BATCH_SIZE": n, "MICRO_BATCH_SIZE": args.micro_batch,
                  "STREAM_CHUNK_SIZE": args.chunk, "TAU": args.tau, "PHASE_B": args.phase_b}
        held_out = [t.to(rt.device) for t in paired_data(1000, seed=args.seed + 1, dtype=dtype)]
        before = retrieval_accuracy(model, *held_out)
        dropout_seed = args.seed + 1000
        torch.manual_seed(dropout_seed + rt.rank)  # each rank its own dropout stream, as in real DDP

        # The seed's example loop.
        losses, first_grads, mem = [], {}, PeakMemory()
        for epoch in range(args.epochs):
            loader.sampler.set_epoch(epoch)
            for batch_idx, (local_x, local_y) in enumerate(loader):
                local_x, local_y = local_x.to(rt.device), local_y.to(rt.device)
                with mem if not losses else nullcontext():  # measure step 1
                    loss = distributed_train_step(ddp, optimizer, local_x, local_y, config)
                first_grads = first_grads or grads_of(model)
                losses.append(loss)
                if dist.get_rank() == 0:
                    print0(f"Epoch {epoch}, Step {batch_idx}, Loss: {loss:.4f}")

        # Self-check 1: step 1 against the single-process full batch.
        idx = global_first_batch(dataset, world, local, args.seed)
        ref_grads, ref_loss = reference_first_step(reference_model, x[idx].to(rt.device),
                                                   y[idx].to(rt.device), world, args.micro_batch,
                                                   args.tau, dropout_seed)
        rows = compare(ref_grads, first_grads)
        rtol, atol = tolerances(dtype)
        print0(comparison_table(rows, "Step 1 gradients: streamed five-phase step vs single-process full batch",
                                caption=f"rank 0; allclose with rtol {rtol:g}, atol {atol:g}"))
        loss_ok = abs(losses[0] - ref_loss) <= atol + rtol * abs(ref_loss)
        print0(f"step 1 loss: streamed {losses[0]:.12f}, full batch {ref_loss:.12f}")

        # Self-check 2: the memory account.
        itemsize = torch.empty((), dtype=dtype).element_size()
        d = model.encoder_x[-1].out_features
        print0(memory_table(mem, n, d, local, args.micro_batch, args.chunk, itemsize))
        # O(N d + tiles): nothing bigger than the gathered embeddings or one tile was ever made.
        tile = max(min(args.micro_batch, local), min(args.chunk, n)) * min(args.chunk, n)
        small = mem.largest_bytes <= max(n * 2 * d, tile) * itemsize
        after = retrieval_accuracy(model, *held_out)
        print0(f"held-out top-1 retrieval (1000 pairs): {before:.1%} before, {after:.1%} after "
               f"{len(losses)} steps; loss {losses[0]:.3f} -> {losses[-1]:.3f}")

        ok = all_ranks_true(all_ok(rows) and loss_ok and small and losses[-1] < losses[0], rt.device)
        print0(f"\n[bold]{'PASS' if ok else 'FAIL'}[/]: step 1's gradients and loss "
               f"{'equal' if all_ok(rows) and loss_ok else 'DO NOT equal'} the full batch's; the largest "
               f"temporary is {mem.largest_bytes / (n * n * itemsize):.2%} of N x N and "
               f"{'no bigger' if small else 'BIGGER'} than the gathered embeddings or one tile")
    return 0 if ok else 1


if __name__ == "__main__":
    run_main(main)
