"""Lesson 21: contrastive (CLIP) learning under DDP, global x global: every rank gathers all N
embeddings and computes the whole N x N loss, and DDP's average then gives 1/P of its gradient.

    torchrun --nproc-per-node 4 lessons/21_contrastive_global.py     # any P that divides N

The idea. The symmetric InfoNCE loss does not split over samples: pair i's term has every other
pair's embeddings in its softmax. With unit-norm Z_x, Z_y (N x d) and S = Z_x Z_y^T / tau,

    L = 1/(2N) * sum_i [ -log softmax_row(S)_ii - log softmax_col(S)_ii ].

Under DDP rank r holds only its C = N/P pairs, so it all-gathers Z_x and Z_y and computes L itself,
the same number on every rank. `dist.all_gather` carries no gradient, so the rank puts its own block
back with its graph; its backward then reaches only its own embeddings and finds
g_r = dL/dZ[rC:(r+1)C] * dZ[rC:(r+1)C]/dtheta, the part of the gradient that flows through its C
samples.

The mechanism is written out below: `all_gather_blocks` (one all-gather of every rank's C x d block,
no autograd), `gather_plain` (the same, with this rank's block put back with its graph), `global_loss`
and the fix `global_loss_times_p`. The library's twins (src/distlab/contrastive/gather.py and
variants.py, which lessons 22-25 use) are proven equal: the same losses and gradients, bit for bit.

The missing factor. The full gradient is the SUM over blocks, dL/dtheta = sum_r g_r, but DDP
AVERAGES (lesson 06, part 5: right for a mean over samples, not for a loss every rank computes
whole): 1/P * sum_r g_r = dL/dtheta / P. Training still "converges": for SGD the bug is a P times
smaller learning rate, and Adam divides the gradient's scale away, so a run can look right while its
gradient is P times too small. The fix here: back-propagate P * L and report L
(`global_loss_times_p`), no extra communication. Lesson 23 derives another, a gather whose backward
sums over ranks, which the later lessons build on.

The cost. Every rank computes the same N x N logits, forward and backward: P N^2 entries in all where
N^2 would do, so (P-1)/P of that work is redundant, and each rank holds N x N logits however many
ranks share the batch. Lesson 22 computes only the rows a rank owns.

The proof: every variant against a deep copy of the model run on the whole global batch in one
process (plain autograd on `clip_loss`); the lesson exits non-zero unless the plain gather gives
exactly 1/P of that gradient, back-propagating P * L gives all of it, and every loss equals the
reference's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from distlab.comm import compat
from distlab.contrastive import variants as library
from distlab.contrastive.losses import clip_loss
from distlab.contrastive.reference import full_batch_gradients
from distlab.contrastive.report import method_table, work_table
from distlab.contrastive.step import first_step_gradients
from distlab.contrastive.variants import Losses, Variant
from distlab.processes.console import print0
from distlab.processes.flags import check_flags_against_world, divides_global_batch
from distlab.processes.identity import Runtime
from distlab.processes.runtime import distributed, run_main
from distlab.proof.cli import add_contrastive_args, lesson_parser
from distlab.proof.compare import DTYPES, all_ok, compare, compare_whole, comparison_table, tolerances
from distlab.proof.models import TwoTower, paired_data
from distlab.proof.verdict import Verdict

# ---- the mechanism: the gather, the global loss, and the P-times fix -----------------------------


def all_gather_blocks(z: torch.Tensor) -> torch.Tensor:
    """Every rank's C x d block stacked in rank order: N x d, the same on every rank. No autograd: the
    result is plain numbers, with no path back to any rank's encoder."""
    out = z.new_empty((dist.get_world_size() * len(z), *z.shape[1:]))
    compat.all_gather_single(out, z.contiguous())  # one message per rank, into one buffer
    return out


def gather_plain(z: torch.Tensor) -> torch.Tensor:
    """All-gather, then this rank's own block put back in its place WITH its graph: the gathered N x d
    reaches this rank's encoder through its own rows, and no one else's."""
    blocks = list(all_gather_blocks(z.detach()).chunk(dist.get_world_size()))
    blocks[dist.get_rank()] = z
    return torch.cat(blocks)


def global_loss(rt: Runtime, z_x: torch.Tensor, z_y: torch.Tensor, tau: float, gather) -> Losses:
    """Every rank gathers both towers and computes the whole N x N loss: the same L everywhere. Its
    backward on rank r finds g_r only, the part of dL/dtheta through rank r's C pairs."""
    loss = clip_loss(gather(z_x), gather(z_y), 1 / tau)  # clip_loss takes the logit scale s = 1/tau
    return loss, loss.detach()


def global_loss_times_p(rt: Runtime, z_x: torch.Tensor, z_y: torch.Tensor, tau: float, gather) -> Losses:
    """The fix: back-propagate P L, report L. DDP averages the P ranks' P g_r into sum_r g_r = dL/dtheta."""
    loss, value = global_loss(rt, z_x, z_y, tau, gather)
    return rt.world_size * loss, value


GLOBAL_PLAIN = Variant("plain", global_loss, gather_plain)
GLOBAL_TIMES_P = Variant("plain, P L", global_loss_times_p, gather_plain)  # the fix (exercise 21)
VARIANTS = (GLOBAL_PLAIN, GLOBAL_TIMES_P)
TWINS = {GLOBAL_PLAIN.name: library.GLOBAL_PLAIN, GLOBAL_TIMES_P.name: library.GLOBAL_TIMES_P}


# ---- the chapter, part by part -------------------------------------------------------------------


def same_as_library(rt, ours: dict, n: int, tau: float, seed: int, dtype: torch.dtype, twins=TWINS) -> bool:
    """The library's variants (src/distlab/contrastive) on the step `ours` took (`first_step_gradients` of
    VARIANTS): L and every gradient, bit for bit."""
    theirs = first_step_gradients(rt, list(twins.values()), n, tau, seed=seed, dtype=dtype)
    return all(
        ours[name][0] == theirs[twin.name][0] and all_ok(compare(ours[name][1], theirs[twin.name][1], 0.0, 0.0))
        for name, twin in twins.items()
    )


def parse_args():
    parser = add_contrastive_args(lesson_parser(__doc__), global_batch=384)
    parser.add_argument("--dtype", choices=DTYPES, default="float64", help="dtype of weights and data")
    return parser.parse_args()


def show_gradients(ref, ref_loss: float, ddp: dict, rows: list, dtype: torch.dtype) -> None:
    """The tables of main's comparison: each variant's DDP gradient against the one-process reference
    (`rows`), the fix per parameter, and every variant's loss beside the reference's."""
    rtol, atol = tolerances(dtype)
    print0(
        method_table(
            rows,
            "DDP gradients after one step vs the single-process full batch (ref)",
            caption=f"allclose: rtol {rtol:g}, atol {atol:g}; plain, P L: the plain gather, backward of P * L",
        )
    )
    print0(
        comparison_table(
            compare(ref, ddp[GLOBAL_TIMES_P.name][1]),
            "backward of P * L, per parameter, vs ref",
            caption=f"allclose with rtol {rtol:g}, atol {atol:g}",
        )
    )
    losses = {v.name: ddp[v.name][0] for v in VARIANTS}
    print0(
        f"loss L: reference {ref_loss:.12f}; " + "; ".join(f"{k} {v:.12f}" for k, v in losses.items()),
        highlight=False,
    )


def main() -> int:
    args = check_flags_against_world(parse_args(), divides_global_batch)
    dtype = DTYPES[args.dtype]
    with distributed(args.device) as rt:
        P, n = rt.world_size, args.global_batch
        verdict = Verdict(rt)
        print0(
            f"[bold]Lesson 21: DDP contrastive, global x global[/] - N = {n} pairs, P = {P}, C = {n // P}, "
            f"tau = {args.tau}, {args.dtype}, {rt.backend}",
            highlight=False,
        )
        ddp = first_step_gradients(rt, VARIANTS, n, args.tau, seed=args.seed, dtype=dtype)

        # The independent reference: a deep copy of the model, the whole batch, one process.
        model = TwoTower(seed=args.seed, dtype=dtype)
        ref_loss, ref = full_batch_gradients(model, *paired_data(n, seed=args.seed, dtype=dtype), 1 / args.tau)
        plain = compare_whole(ref, ddp[GLOBAL_PLAIN.name][1])
        plain_over_p = compare_whole(ref, ddp[GLOBAL_PLAIN.name][1], scale=1 / P)
        fixed = {GLOBAL_TIMES_P.name: compare_whole(ref, ddp[GLOBAL_TIMES_P.name][1])}
        rows = [(GLOBAL_PLAIN.name, "ref", plain, P == 1), (GLOBAL_PLAIN.name, "ref / P", plain_over_p, True)]
        rows += [(name, "ref", err, True) for name, err in fixed.items()]
        show_gradients(ref, ref_loss, ddp, rows, dtype)
        losses = {v.name: ddp[v.name][0] for v in VARIANTS}
        print0(work_table(n, P, model.encoder_x[-1].out_features))
        rtol, atol = tolerances(dtype)

        verdict.check(
            "the plain gather gives exactly 1/P of the full-batch gradient",
            plain_over_p.ok,
            f"||g|| / ||ref|| = {plain.norm_ratio:.6f}, 1/P = {1 / P:.6f}",
        )
        for name, err in fixed.items():
            verdict.check(f"{name} gives the full-batch gradient", err.ok, f"max rel err {err.max_rel:.1e}")
        verdict.check(
            "every variant's loss equals the reference's",
            all(abs(v - ref_loss) <= atol + rtol * abs(ref_loss) for v in losses.values()),
        )
        verdict.check(
            "the library's gather and losses = the lesson's: L and every gradient, bit for bit",
            same_as_library(rt, ddp, n, args.tau, args.seed, dtype),
        )
        verdict.figure("norm_ratio_plain", plain.norm_ratio)
        verdict.figure(
            "max_rel_err",
            {"plain_vs_ref_over_p": plain_over_p.max_rel, **{name: err.max_rel for name, err in fixed.items()}},
        )
        return verdict.finish(args.json)


if __name__ == "__main__":
    run_main(main)
