"""Lesson 07: contrastive (CLIP) learning under DDP, global x global. Every rank gathers all N
embeddings and computes the whole N x N similarity matrix.

    torchrun --nproc-per-node 2 lessons/07_contrastive_global.py     # any P that divides N

The idea. The symmetric InfoNCE loss does not split over samples: pair i's term has every other
pair's embeddings in its softmax. With unit-norm Z_x, Z_y (N x d) and S = Z_x Z_y^T / tau,

    L = 1/(2N) * sum_i [ -log softmax_row(S)_ii - log softmax_col(S)_ii ].

Under DDP rank r holds only its C = N/P pairs, so it all-gathers Z_x and Z_y and computes L itself:
the same number on every rank. `dist.all_gather` carries no gradient, so the rank puts its own block
back with its graph (seed 003's CODE BLOCK 1). Its backward then reaches only its own embeddings and
finds g_r = dL/dz_r * dz_r/dtheta, the part of the gradient that flows through its C samples.

What the seed's "CODE BLOCK 1 worked" story misses. The full gradient is the SUM over blocks,
dL/dtheta = sum_r g_r, but DDP AVERAGES: 1/P * sum_r g_r = dL/dtheta / P. The seed's argument
(the common factor before the gather can be pulled out, so averaging equals the non-distributed
gradient) drops exactly this factor. It still "converges": for SGD it is a P-times smaller
learning rate, and Adam normalises the gradient scale away. Two exact fixes, both checked here:

- `global_plain_xP`: back-propagate P * L (report L): no extra communication;
- `global_sum`: a gather whose backward sums the gradient over ranks (lesson 09's AllGather): every
  rank's copy of L sends its dL/dz_r to rank r, which receives P * dL/dz_r; DDP's average then gives
  sum_r g_r exactly. It costs one reduce-scatter of N x d per gathered tensor in backward.

The cost. Every rank computes the same N x N logits, forward and backward: P * N^2 entries in total
where N^2 would do, so (P-1)/P of that work is redundant, and each rank holds N x N logits however
many ranks share the batch. Lesson 09 computes only the rows a rank owns.

The seed's other bugs: its CODE BLOCK 1 gathers `feature1` into `all_feature2` (so the negatives on
the y side are x embeddings), multiplies Python lists with `torch.matmul` (they need `torch.cat`),
and has no temperature.

The self-check compares every variant with a deep copy of the model run on the whole global batch in
one process (plain autograd on `clip_loss`), and exits non-zero unless the plain gather gives exactly
1/P of it and both fixes give it exactly.
"""

from __future__ import annotations

import argparse

from rich.table import Table

from distlab.cli import DTYPES
from distlab.compare import compare, comparison_table, tolerances
from distlab.contrastive.ddp_steps import GLOBAL_METHODS, first_step_gradients
from distlab.contrastive.reference import full_batch_gradients
from distlab.contrastive.report import gradient_error, method_table
from distlab.models import TwoTower, paired_data
from distlab.runtime import add_runtime_args, all_ranks_true, distributed, print0, run_main

SEED_CODE = {
    "global_plain": "CODE BLOCK 1 (feature bug fixed)",
    "global_plain_xP": "CODE BLOCK 1, backward of P * L",
    "global_sum": "gather with sum-backward",
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-size", type=int, default=384, help="the global batch N (P must divide it)")
    parser.add_argument("--tau", type=float, default=0.1, help="temperature (> 0)")
    parser.add_argument("--dtype", choices=DTYPES, default="float64")
    return add_runtime_args(parser).parse_args()


def work_table(n: int, p: int, d: int) -> Table:
    """Who computes what: the N x N logits (matmul), and the row and column softmaxes over them."""
    table = Table(title="The redundant work: every rank computes the same N x N similarity matrix",
                  title_justify="left")
    for column in ("", "S entries (matmul)", "multiply-adds Z_x Z_y^T", "softmax entries (rows + columns)"):
        table.add_column(column, justify="right" if column else "left")
    for who, k in (("one rank", 1), (f"all {p} ranks", p), ("needed once", 1), ("redundant", p - 1)):
        factor = "" if k == 1 else f"{k} x "
        table.add_row(who, f"{factor}N^2 = {k * n * n:,}", f"{factor}N^2 d = {k * n * n * d:,}",
                      f"{factor}2N^2 = {2 * k * n * n:,}")
    return table


def main() -> int:
    args = parse_args()
    dtype = DTYPES[args.dtype]
    with distributed(args.device) as rt:
        p, n = rt.world_size, args.batch_size
        print0(f"[bold]Lesson 07: DDP contrastive, global x global[/] - N = {n} pairs on {p} rank(s) "
               f"(C = {n / p:g} each), tau = {args.tau}, backend {rt.backend}, {args.dtype}")
        results = first_step_gradients(rt, GLOBAL_METHODS, n, args.tau, seed=args.seed, dtype=dtype)

        # The independent reference: a deep copy of the model, the whole batch, one process.
        x, y = paired_data(n, seed=args.seed, dtype=dtype)
        model = TwoTower(seed=args.seed, dtype=dtype)
        ref_loss, ref_grads = full_batch_gradients(model, x, y, args.tau)

        rtol, atol = tolerances(dtype)
        plain = gradient_error(ref_grads, results["global_plain"][1], scale=1 / p)
        plain_raw = gradient_error(ref_grads, results["global_plain"][1])
        rows = [("global_plain", "reference", plain_raw, p == 1),
                ("global_plain", f"reference / P = / {p}", plain, True)]
        exact = {m: gradient_error(ref_grads, results[m][1]) for m in ("global_plain_xP", "global_sum")}
        rows += [(m, "reference", err, True) for m, err in exact.items()]
        print0(method_table(rows, "DDP gradients after one step vs the single-process full batch",
                            caption=f"allclose: rtol {rtol:g}, atol {atol:g}; seed 003's code: "
                            + "; ".join(f"{m} = {c}" for m, c in SEED_CODE.items())))
        print0(comparison_table(compare(ref_grads, results["global_sum"][1]),
                                "global_sum, per parameter, vs the reference",
                                caption=f"allclose with rtol {rtol:g}, atol {atol:g}"))
        losses = {m: results[m][0] for m in GLOBAL_METHODS}
        losses_ok = all(abs(v - ref_loss) <= atol + rtol * abs(ref_loss) for v in losses.values())
        print0(f"loss L: reference {ref_loss:.12f}; DDP " + ", ".join(f"{m} {v:.12f}" for m, v in losses.items()))
        print0(work_table(n, p, model.encoder_x[-1].out_features))

        claim = plain.ok and all(err.ok for err in exact.values()) and losses_ok
        ok = all_ranks_true(claim, rt.device)
        print0(f"\n[bold]{'PASS' if ok else 'FAIL'}[/]: the plain gather gives "
               f"{'exactly 1/P of' if plain.ok else 'NOT 1/P of'} the full-batch gradient "
               f"(||g||/||ref|| = {plain_raw.norm_ratio:.6f}, 1/P = {1 / p:.6f}); backward of P * L and the "
               f"sum-backward gather {'are exact' if all(e.ok for e in exact.values()) else 'are NOT exact'}; "
               f"the loss {'equals' if losses_ok else 'DOES NOT equal'} the reference's")
    return 0 if ok else 1


if __name__ == "__main__":
    run_main(main)
