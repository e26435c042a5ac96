"""Lesson 23: the fix. An all-gather whose backward sums the gradient over ranks makes local x global
exact again, at C x N logits per rank instead of N x N.

    torchrun --nproc-per-node 4 lessons/23_contrastive_allgather_fix.py     # any P that divides N

The idea. Rank r's embeddings z_r enter every rank's local loss L_s. On rank s the gathered tensor is
Z = [z_0; ...; z_{P-1}] (N x d: Z_x or Z_y), and rank s's backward produces dL_s/dZ, a gradient for
every block. The chain rule wants, for rank r's block, the sum over all ranks:

    grad z_r = sum_s dL_s/dZ[rC : (r+1)C].

So the gather's backward must SUM the incoming gradient over ranks and hand rank r its rows. Then
DDP's average gives 1/P sum_r sum_s dL_s/dz_r dz_r/dtheta = dL/dtheta with L = 1/P sum_s L_s: exact.

The mechanism is `AllGatherSumBackward` below: forward an all-gather, backward an all_reduce (sum)
of the N x d gradient and this rank's C rows of it, both ends of the slice from the rank saved in
forward. The lesson checks it with two other sums:

- `gather_with_grad` (src/distlab/contrastive/gather.py, `GatherSumBackward`): the sum and the
  slice in one reduce_scatter; each rank receives only its summed C rows, the same numbers for half
  the traffic. Lessons 24 and 25 import this one.
- torch's own differentiable gather (`gather_library`): torch 2.13 deprecates
  `torch.distributed.nn.functional.all_gather` and names
  `torch.distributed._functional_collectives.all_gather_single` as its replacement; that op has a
  registered backward, a reduce-scatter with sum. The one to use in real code.

A README that circulates with this design, EfficientDDP-4-Contrastive-Train
(https://github.com/zsnoob/EfficientDDP-4-Contrastive-Train), gets three things wrong, all checked in
lessons 21-23: it says global x global under DDP trains like one process (DDP's average makes the
gradient 1/P of it, lesson 21); its `AllGather` slices its backward with a `rank` it never defines
(here, the rank saved in forward); and it prefers an all_reduce because with a reduce-scatter "only
one node does the scatter work" (every rank reduces and receives its own slice, in parallel, sending
(P-1)/P N d numbers where the all_reduce sends twice that).

The cost. Each rank builds two C x N logit matrices (rows of S, rows of S^T) instead of one N x N:
2N^2/P matmul entries instead of N^2 (equal at P = 2, a saving beyond), softmaxes over 2CN entries
instead of 2N^2 (P times fewer), and no tensor larger than C x N. The backward adds one collective
per gathered tensor: ring formulas below, in bytes, and measured times.

The proof: every variant's gradient after one step against a deep copy of the model run on the
whole global batch in one process; exit non-zero unless the three sums are exact, lesson 22's plain
gather is not (at P > 1), and the largest tensor per rank is C x N instead of N x N.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from distlab.comm import compat
from distlab.contrastive.cost import collective_seconds, global_logits, local_logits, loss_cost
from distlab.contrastive.reference import full_batch_gradients
from distlab.contrastive.report import comm_table, cost_table, method_table
from distlab.contrastive.step import first_step_gradients
from distlab.contrastive.variants import GLOBAL_SUM, LOCAL_LIBRARY, LOCAL_PLAIN, LOCAL_SUM, Variant, local_loss
from distlab.processes.console import print0
from distlab.processes.flags import check_flags_against_world, divides_global_batch, positive_int
from distlab.processes.identity import Runtime
from distlab.processes.runtime import distributed, run_main
from distlab.proof.cli import add_contrastive_args, lesson_parser
from distlab.proof.compare import DTYPES, compare_whole, tolerances
from distlab.proof.memory import MIB
from distlab.proof.models import TwoTower, paired_data
from distlab.proof.verdict import Verdict

# ---- the mechanism: the sum-backward all-gather, by hand -----------------------------------------


class AllGatherSumBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z: torch.Tensor) -> torch.Tensor:  # z: this rank's C x d block
        ctx.rank, ctx.c = dist.get_rank(), len(z)  # the rank within the group gathered over
        gathered = z.new_empty((dist.get_world_size() * len(z), *z.shape[1:]))
        compat.all_gather_single(gathered, z.contiguous())  # Z: N x d, rank r's rows at rC .. rC + C - 1
        return gathered

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # grad: dL_s/dZ on this rank s, N x d
        summed = grad.contiguous().clone()  # (autograd's buffer is not ours to change)
        dist.all_reduce(summed, op=dist.ReduceOp.SUM)  # sum_s dL_s/dZ, on every rank
        return summed[ctx.rank * ctx.c : (ctx.rank + 1) * ctx.c]  # grad z_r: this rank's C rows


def gather_all_reduce(z: torch.Tensor) -> torch.Tensor:
    return AllGatherSumBackward.apply(z)


LOCAL_ALL_REDUCE = Variant("all_reduce", local_loss, gather_all_reduce)
FIXES = (LOCAL_ALL_REDUCE, LOCAL_SUM, LOCAL_LIBRARY)


# ---- the chapter, part by part -------------------------------------------------------------------


def parse_args():
    parser = add_contrastive_args(lesson_parser(__doc__), global_batch=384)
    parser.add_argument("--dtype", choices=DTYPES, default="float64", help="dtype of the exactness check")
    parser.add_argument(
        "--cost-global-batch",
        type=positive_int,
        default=1536,
        help="N of the memory and time measurement (float32, P must divide it)",
    )
    parser.add_argument(
        "--comm-global-batch",
        type=positive_int,
        default=6144,
        help="N of the N x d gradient whose backward collectives are timed (P must divide it)",
    )
    parser.add_argument("--comm-dim", type=positive_int, default=256, help="d of that gradient (float32)")
    return parser.parse_args()


def exactness(rt: Runtime, args, verdict: Verdict) -> None:
    """One step of every sum, and of lesson 22's plain gather, against the full-batch reference."""
    world, n, dtype = rt.world_size, args.global_batch, DTYPES[args.dtype]
    ddp = first_step_gradients(rt, FIXES + (LOCAL_PLAIN,), n, args.tau, seed=args.seed, dtype=dtype)
    ref_loss, ref = full_batch_gradients(
        TwoTower(seed=args.seed, dtype=dtype), *paired_data(n, seed=args.seed, dtype=dtype), 1 / args.tau
    )
    errors = {v.name: compare_whole(ref, ddp[v.name][1]) for v in FIXES + (LOCAL_PLAIN,)}
    rtol, atol = tolerances(dtype)
    rows = [(v.name, "ref", errors[v.name], True) for v in FIXES]
    rows.append((f"{LOCAL_PLAIN.name} (11)", "ref", errors[LOCAL_PLAIN.name], world == 1))
    print0(
        method_table(
            rows,
            "DDP gradients after one step vs the single-process full batch (ref)",
            caption=f"allclose: rtol {rtol:g}, atol {atol:g}; all_reduce: this lesson's "
            "AllGatherSumBackward; reduce_scatter: gather_with_grad; torch: all_gather_single",
        )
    )
    print0(
        f"loss L: reference {ref_loss:.12f}; " + "; ".join(f"{v.name} {ddp[v.name][0]:.12f}" for v in FIXES),
        highlight=False,
    )
    for v in FIXES:
        verdict.check(
            f"the {v.name} gather gives the full-batch gradient",
            errors[v.name].ok,
            f"max rel err {errors[v.name].max_rel:.1e}",
        )
    verdict.check(
        "lesson 22's plain gather " + ("does not" if world > 1 else "does, at P = 1"),
        errors[LOCAL_PLAIN.name].ok == (world == 1),
        f"max rel err {errors[LOCAL_PLAIN.name].max_rel:.2e}",
    )
    verdict.check(
        "every loss equals the reference's",
        all(abs(ddp[v.name][0] - ref_loss) <= atol + rtol * abs(ref_loss) for v in FIXES),
    )
    verdict.figure("max_rel_err", {name: err.max_rel for name, err in errors.items()})


def cost(rt: Runtime, args, verdict: Verdict) -> None:
    """What the loss costs one rank, global x global against local x global, on unit-norm float32
    embeddings (what the model would output); then the backward collectives alone."""
    world, n = rt.world_size, args.cost_global_batch
    gen = torch.Generator().manual_seed(args.seed + rt.rank)
    z = [F.normalize(torch.randn(n // world, 64, generator=gen), dim=-1).to(rt.device) for _ in range(2)]
    global_cost, local_cost = (loss_cost(rt, *z, args.tau, v) for v in (GLOBAL_SUM, LOCAL_SUM))
    print0(
        cost_table(
            n,
            world,
            [("global (10)", global_logits(n), global_cost), ("local", local_logits(n, world), local_cost)],
            e=4,
        )
    )
    seconds = collective_seconds(rt, args.comm_global_batch, args.comm_dim, torch.float32)
    print0(comm_table(world, args.comm_global_batch, args.comm_dim, 4, seconds, rt.backend))
    local, full = local_cost["largest_bytes"], global_cost["largest_bytes"]
    verdict.check(
        "the largest tensor per rank is C x N, not N x N",
        full == n * n * 4 and local == n // world * n * 4,
        f"{local / MIB:.2f} MiB instead of {full / MIB:.2f} MiB",
    )
    verdict.figure("cost", {"global": global_cost, "local": local_cost, "collective_seconds": seconds})


def world_rules(args, world_size: int) -> None:
    """P divides each of the three global batches."""
    for flag in ("--global-batch", "--cost-global-batch", "--comm-global-batch"):
        divides_global_batch(args, world_size, flag)


def main() -> int:
    args = check_flags_against_world(parse_args(), world_rules)
    with distributed(args.device) as rt:
        world = rt.world_size
        verdict = Verdict(rt)
        print0(
            f"[bold]Lesson 23: the sum-backward all-gather[/] - N = {args.global_batch} pairs, P = {world}, "
            f"C = {args.global_batch // world}, tau = {args.tau}, {args.dtype}, {rt.backend}",
            highlight=False,
        )
        exactness(rt, args, verdict)
        cost(rt, args, verdict)
        return verdict.finish(args.json)


if __name__ == "__main__":
    run_main(main)
