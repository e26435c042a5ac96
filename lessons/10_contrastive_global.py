"""Lesson 10: contrastive (CLIP) learning under DDP, global x global: every rank gathers all N
embeddings and computes the whole N x N loss, and DDP's average then gives 1/P of its gradient.

    torchrun --nproc-per-node 4 lessons/10_contrastive_global.py     # any P that divides N

The idea. The symmetric InfoNCE loss does not split over samples: pair i's term has every other
pair's embeddings in its softmax. With unit-norm Z_x, Z_y (N x d) and S = Z_x Z_y^T / tau,

    L = 1/(2N) * sum_i [ -log softmax_row(S)_ii - log softmax_col(S)_ii ].

Under DDP rank r holds only its C = N/P pairs, so it all-gathers Z_x and Z_y and computes L itself,
the same number on every rank. `dist.all_gather` carries no gradient, so the rank puts its own block
back with its graph; its backward then reaches only its own embeddings and finds
g_r = dL/dZ[rC:(r+1)C] * dZ[rC:(r+1)C]/dtheta, the part of the gradient that flows through its C
samples.

The mechanism: src/distlab/contrastive/variants.py, `global_loss` (and `global_loss_times_p`), with
the gather `gather_plain` of src/distlab/contrastive/gather.py.

The missing factor. The full gradient is the SUM over blocks, dL/dtheta = sum_r g_r, but DDP
AVERAGES (lesson 06, part 5: right for a mean over samples, not for a loss every rank computes
whole): 1/P * sum_r g_r = dL/dtheta / P. Training still "converges": for SGD the bug is a P times
smaller learning rate, and Adam divides the gradient's scale away, so a run can look right while its
gradient is P times too small. The fix here: back-propagate P * L and report L
(`global_loss_times_p`), no extra communication. Lesson 12 derives another, a gather whose backward
sums over ranks, which the later lessons build on.

The cost. Every rank computes the same N x N logits, forward and backward: P N^2 entries in all where
N^2 would do, so (P-1)/P of that work is redundant, and each rank holds N x N logits however many
ranks share the batch. Lesson 11 computes only the rows a rank owns.

The proof: every variant against a deep copy of the model run on the whole global batch in one
process (plain autograd on `clip_loss`); the lesson exits non-zero unless the plain gather gives
exactly 1/P of that gradient, back-propagating P * L gives all of it, and every loss equals the
reference's.
"""

from __future__ import annotations

from distlab.cli import DTYPES, add_contrastive_args, check_flags_against_world, divides_global_batch, lesson_parser
from distlab.compare import compare, compare_whole, comparison_table, tolerances
from distlab.console import print0
from distlab.contrastive.gather import gather_plain
from distlab.contrastive.reference import full_batch_gradients
from distlab.contrastive.report import method_table, work_table
from distlab.contrastive.step import first_step_gradients
from distlab.contrastive.variants import GLOBAL_PLAIN, Variant, global_loss_times_p
from distlab.models import TwoTower, paired_data
from distlab.runtime import distributed, run_main
from distlab.verdict import Verdict

GLOBAL_TIMES_P = Variant("plain, P L", global_loss_times_p, gather_plain)  # the fix (exercise 10)
VARIANTS = (GLOBAL_PLAIN, GLOBAL_TIMES_P)


def parse_args():
    parser = add_contrastive_args(lesson_parser(__doc__), global_batch=384)
    parser.add_argument("--dtype", choices=DTYPES, default="float64", help="dtype of weights and data")
    return parser.parse_args()


def main() -> int:
    args = check_flags_against_world(parse_args(), divides_global_batch)
    dtype = DTYPES[args.dtype]
    with distributed(args.device) as rt:
        p, n = rt.world_size, args.global_batch
        verdict = Verdict(rt)
        print0(
            f"[bold]Lesson 10: DDP contrastive, global x global[/] - N = {n} pairs, P = {p}, C = {n // p}, "
            f"tau = {args.tau}, {args.dtype}, {rt.backend}",
            highlight=False,
        )
        ddp = first_step_gradients(rt, VARIANTS, n, args.tau, seed=args.seed, dtype=dtype)

        # The independent reference: a deep copy of the model, the whole batch, one process.
        model = TwoTower(seed=args.seed, dtype=dtype)
        ref_loss, ref = full_batch_gradients(model, *paired_data(n, seed=args.seed, dtype=dtype), 1 / args.tau)
        plain = compare_whole(ref, ddp[GLOBAL_PLAIN.name][1])
        plain_over_p = compare_whole(ref, ddp[GLOBAL_PLAIN.name][1], scale=1 / p)
        fixed = {GLOBAL_TIMES_P.name: compare_whole(ref, ddp[GLOBAL_TIMES_P.name][1])}
        rtol, atol = tolerances(dtype)
        rows = [(GLOBAL_PLAIN.name, "ref", plain, p == 1), (GLOBAL_PLAIN.name, "ref / P", plain_over_p, True)]
        rows += [(name, "ref", err, True) for name, err in fixed.items()]
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
        print0(work_table(n, p, model.encoder_x[-1].out_features))

        verdict.check(
            "the plain gather gives exactly 1/P of the full-batch gradient",
            plain_over_p.ok,
            f"||g|| / ||ref|| = {plain.norm_ratio:.6f}, 1/P = {1 / p:.6f}",
        )
        for name, err in fixed.items():
            verdict.check(f"{name} gives the full-batch gradient", err.ok, f"max rel err {err.max_rel:.1e}")
        verdict.check(
            "every variant's loss equals the reference's",
            all(abs(v - ref_loss) <= atol + rtol * abs(ref_loss) for v in losses.values()),
        )
        verdict.figure("norm_ratio_plain", plain.norm_ratio)
        verdict.figure(
            "max_rel_err",
            {"plain_vs_ref_over_p": plain_over_p.max_rel, **{name: err.max_rel for name, err in fixed.items()}},
        )
        return verdict.finish(args.json)


if __name__ == "__main__":
    run_main(main)
