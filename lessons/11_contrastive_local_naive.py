"""Lesson 11: local x global with a plain all_gather. Each rank computes only its own C rows of the
logits; the loss is still exact, the gradient is not.

    torchrun --nproc-per-node 4 lessons/11_contrastive_local_naive.py     # any P that divides N

The idea. Lesson 10 had every rank compute all N x N logits. Rank r only needs its own rows: the
C x N block of S = Z_x Z_y^T / tau for its anchors z_x (x -> y), and the C x N block of S^T for its
z_y (y -> x), with the positives at columns rC + i. Its local loss L_r is the mean over those rows,
and the global loss is their average, L = 1/P sum_r L_r: the forward pass is exact.

The mechanism: src/distlab/contrastive/variants.py, `local_loss` with `gather_plain`
(src/distlab/contrastive/gather.py): `dist.all_gather`, then this rank's own block put back into the
result so that it keeps its graph.

The gradient is not exact. Rank r's embeddings z_r appear in every L_s: in L_r as anchors and
positives, and in every other L_s as negatives (columns of rank s's rows). The true gradient is

    dL/dz_r = 1/P * sum_s dL_s/dz_r,

but rank r back-propagates L_r alone and finds dL_r/dz_r; DDP then averages, 1/P sum_r
dL_r/dz_r * dz_r/dtheta: every term with s != r, "rank r's samples as negatives in another rank's
rows", is computed nowhere. What DDP delivers is the gradient of 1/P sum_r L_r(z_r, the other blocks
detached), and the lesson checks exactly that against a single-process computation of it
(`DetachedBlocks` in src/distlab/contrastive/reference.py). At P = 1 nothing is lost.

What it does to training. Three runs on the same data, weights, optimizer and steps: (1) one process
on the full global batch, (2) DDP with the plain gather, (3) DDP with the fixed gather of lesson 12.
Run (3) must track run (1) at every step; run (2) follows its own path. The
EfficientDDP-4-Contrastive-Train README (https://github.com/zsnoob/EfficientDDP-4-Contrastive-Train)
reports a fine-tuning run that no longer converged with this gather. On this toy problem it does
converge, to a higher global loss and about the same held-out retrieval accuracy, and `--emulate
8,16,48,240` shows the same up to P = N (one pair per rank): the loss it reaches rises steadily with
P while the accuracy does not fall. The lost terms are only the push a rank's samples get as
negatives in other ranks' rows; the pull towards positives and the push away from every negative,
as anchors, survive. It is a different optimisation from the one asked for, measurably worse at the
loss we set out to minimise, but not a guaranteed divergence; whether it hurts more elsewhere (real
data, learned temperature, other optimisers) is a question to measure, not to assume.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from distlab.cli import add_contrastive_args, lesson_parser, positive_float, positive_int, require
from distlab.compare import compare, comparison_table, gradient_error, tolerances
from distlab.console import print0
from distlab.contrastive.losses import clip_loss
from distlab.contrastive.reference import DetachedBlocks, full_batch_gradients
from distlab.contrastive.report import (emulated_table, method_table, relative_errors,
                                        training_table)
from distlab.contrastive.step import first_step_gradients, wrap_ddp
from distlab.contrastive.training import (OPTIMIZERS, TrainConfig, TrainData, batch_schedule,
                                          retrieval_accuracy, train_ddp, train_single_process)
from distlab.contrastive.variants import LOCAL_PLAIN, LOCAL_SUM
from distlab.models import TwoTower, paired_data
from distlab.runtime import Runtime, distributed, run_main
from distlab.verdict import Verdict

DTYPE = torch.float64
SINGLE, PLAIN, FIXED = "one process", "DDP, plain", "DDP, fixed"


def world_sizes(text: str) -> tuple[int, ...]:
    """--emulate's value: world sizes separated by commas, each a positive integer."""
    sizes = tuple(positive_int(part) for part in text.split(","))
    return tuple(dict.fromkeys(sizes))


def parse_args():
    parser = add_contrastive_args(lesson_parser(__doc__), global_batch=240)
    parser.add_argument("--steps", type=positive_int, default=150, help="training steps of each run")
    parser.add_argument("--train-size", type=positive_int, default=4096, help="training pairs (at least N)")
    parser.add_argument("--held-out", type=positive_int, default=512, help="held-out pairs for retrieval accuracy")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="adam", help="optimizer of every run")
    parser.add_argument("--lr", type=positive_float, default=0.01, help="learning rate")
    parser.add_argument("--eval-every", type=positive_int, default=10, help="steps between accuracy checks")
    parser.add_argument("--emulate", type=world_sizes, default=(), metavar="P1,P2,...",
                        help="also train with the plain gather's loss at these world sizes, emulated in one "
                        "process (each must divide N; e.g. 8,16,48)")
    args = parser.parse_args()
    if args.global_batch > args.train_size:
        parser.error(f"argument --global-batch: N = {args.global_batch} is more than --train-size {args.train_size}")
    if any(args.global_batch % q for q in args.emulate):
        parser.error(f"argument --emulate: every size must divide --global-batch {args.global_batch}, "
                     f"got {','.join(map(str, args.emulate))}")
    return args


def first_step(rt: Runtime, args, verdict: Verdict) -> None:
    """One step's gradient, plain and fixed, against the full batch and the detached blocks."""
    p, n = rt.world_size, args.global_batch
    ddp = first_step_gradients(rt, (LOCAL_PLAIN, LOCAL_SUM), n, args.tau, seed=args.seed, dtype=DTYPE)
    model, (x, y) = TwoTower(seed=args.seed, dtype=DTYPE), paired_data(n, seed=args.seed, dtype=DTYPE)
    ref_loss, ref = full_batch_gradients(model, x, y, 1 / args.tau)
    _, detached = full_batch_gradients(model, x, y, 1 / args.tau, loss_fn=DetachedBlocks(p))
    plain, fixed = ddp[LOCAL_PLAIN.name][1], ddp[LOCAL_SUM.name][1]
    errors = {"ref": gradient_error(ref, plain), "detached": gradient_error(detached, plain)}
    fixed_err = gradient_error(ref, fixed)
    rtol, atol = tolerances(DTYPE)
    print0(method_table([(LOCAL_PLAIN.name, "ref", errors["ref"], p == 1),
                         (LOCAL_PLAIN.name, "detached", errors["detached"], True),
                         ("fixed (12)", "ref", fixed_err, True)],
                        "DDP gradients after one step",
                        caption=f"ref: the single-process full batch; detached: the same with every other "
                        f"block's embeddings detached in each block's rows; allclose: rtol {rtol:g}, atol {atol:g}"))
    print0(comparison_table(compare(ref, plain), "plain gather, per parameter, vs ref", expect_match=p == 1))
    lost = lost_fraction(model, x, y, args.tau, p)
    print0(f"lost at the embeddings (the s != r terms): ||dL/dZ - plain|| / ||dL/dZ|| = "
           f"{lost['z_x']:.1%} for z_x, {lost['z_y']:.1%} for z_y", highlight=False)
    losses = {"plain": ddp[LOCAL_PLAIN.name][0], "fixed": ddp[LOCAL_SUM.name][0]}
    print0(f"loss L: reference {ref_loss:.12f}; " + "; ".join(f"{k} {v:.12f}" for k, v in losses.items()), highlight=False)
    verdict.check("the forward pass is right: both losses equal the reference's",
                  all(abs(v - ref_loss) <= atol + rtol * abs(ref_loss) for v in losses.values()))
    verdict.check("the plain gather's gradient " + ("differs from" if p > 1 else "equals (P = 1)") + " the full batch's",
                  errors["ref"].ok == (p == 1), f"max rel err {errors['ref'].max_rel:.2e}, cosine {errors['ref'].cosine:.4f}")
    verdict.check("the plain gather's gradient is the detached-blocks gradient", errors["detached"].ok,
                  f"max rel err {errors['detached'].max_rel:.1e}")
    verdict.check("the fixed gather's gradient is the full batch's", fixed_err.ok, f"max rel err {fixed_err.max_rel:.1e}")
    verdict.figure("relative_error", {"plain": relative_errors(ref, plain), "fixed": relative_errors(ref, fixed)})
    verdict.figure("lost_fraction", lost)


def lost_fraction(model: TwoTower, x: torch.Tensor, y: torch.Tensor, tau: float, p: int) -> dict[str, float]:
    """At the embeddings, per tower: ||dL/dZ - plain's dZ|| / ||dL/dZ||, the share of the gradient lost."""
    with torch.no_grad():
        z = model(x, y)
    grads = {}
    for name, loss_fn in (("true", clip_loss), ("plain", DetachedBlocks(p))):
        a, b = (t.clone().requires_grad_() for t in z)
        loss_fn(a, b, 1 / tau).backward()
        grads[name] = (a.grad, b.grad)
    return {tower: ((grads["true"][i] - grads["plain"][i]).norm() / grads["true"][i].norm()).item()
            for i, tower in enumerate(("z_x", "z_y"))}


def training(rt: Runtime, args, data: TrainData, config: TrainConfig, verdict: Verdict) -> None:
    """Three runs; the single process runs on rank 0 while the others wait at the broadcast."""
    single = [train_single_process(TwoTower(seed=args.seed, dtype=DTYPE).to(rt.device), data, config,
                                   label=SINGLE) if rt.is_first else None]
    dist.broadcast_object_list(single, src=0, device=rt.device)
    runs = {SINGLE: single[0]}
    for name, variant in ((PLAIN, LOCAL_PLAIN), (FIXED, LOCAL_SUM)):
        runs[name] = train_ddp(rt, wrap_ddp(TwoTower(seed=args.seed, dtype=DTYPE), rt), variant, data, config, name)
    print0(training_table(runs, args.held_out))
    rtol, atol = tolerances(DTYPE)
    track = torch.allclose(torch.tensor(runs[FIXED].losses, dtype=DTYPE), torch.tensor(runs[SINGLE].losses, dtype=DTYPE),
                           rtol=rtol, atol=atol)
    verdict.check("the fixed run's loss equals the single process's at every step", track, f"rtol {rtol:g}, atol {atol:g}")
    verdict.figure("runs", {k: {"losses": r.losses, "final_loss": r.final_loss, "eval_steps": r.eval_steps,
                                "accuracies": r.accuracies} for k, r in runs.items()})


def emulate(rt: Runtime, args, data: TrainData, config: TrainConfig, verdict: Verdict) -> None:
    """Train with the detached-blocks loss for each --emulate P in one process: what DDP with the plain
    gather computes (the tests prove it equal for P <= 4), at world sizes this machine cannot run.
    The ranks share the work round-robin."""
    mine = {}
    for q in args.emulate[rt.rank::rt.world_size]:
        run = train_single_process(TwoTower(seed=args.seed, dtype=DTYPE).to(rt.device), data, config,
                                   loss_fn=DetachedBlocks(q))
        mine[q] = {"final_loss": run.final_loss, "accuracy": run.accuracies[-1]}
    every = [None] * rt.world_size
    dist.all_gather_object(every, mine)
    results = {q: r for part in every for q, r in part.items()}
    print0(emulated_table(results, args.global_batch))
    verdict.figure("emulated", results)


def main() -> int:
    args = parse_args()
    with distributed(args.device) as rt:
        verdict, p, n = Verdict(rt), rt.world_size, args.global_batch
        require(n % p == 0, "--global-batch", f"P = {p} ranks must divide N = {n}")
        print0(f"[bold]Lesson 11: local x global, plain all_gather[/] - N = {n} pairs, P = {p}, C = {n // p}, "
               f"tau = {args.tau}, float64, {rt.backend}", highlight=False)
        first_step(rt, args, verdict)

        train, held_out = (tuple(t.to(rt.device) for t in paired_data(size, seed=seed, dtype=DTYPE))
                           for size, seed in ((args.train_size, args.seed), (args.held_out, args.seed + 1000)))
        data = TrainData(train, held_out, batch_schedule(args.train_size, n, args.steps, seed=args.seed))
        config = TrainConfig(args.tau, args.optimizer, args.lr, args.eval_every)
        start = verdict.figure("start_accuracy",
                               retrieval_accuracy(TwoTower(seed=args.seed, dtype=DTYPE).to(rt.device), *held_out))
        print0(f"\n[bold]Training[/]: {args.steps} steps of N = {n} pairs from {args.train_size}, {args.optimizer} "
               f"lr {args.lr}; held-out accuracy before training {start:.2%}", highlight=False)
        training(rt, args, data, config, verdict)
        if args.emulate:
            emulate(rt, args, data, config, verdict)
        verdict.figure("global_batch", n)
        return verdict.finish(args.json)


if __name__ == "__main__":
    run_main(main)
