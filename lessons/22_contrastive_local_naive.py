"""Lesson 22: local x global with a plain all_gather. Each rank computes only its own C rows of the
logits; the loss is still exact, the gradient is not.

    torchrun --nproc-per-node 4 lessons/22_contrastive_local_naive.py     # any P that divides N

The idea. Lesson 21 had every rank compute all N x N logits. Rank r only needs its own rows: the
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

What it does to training. For each of --seeds seeds, two runs on the same data, weights, optimizer
and steps: one process on the full global batch (the true gradient), and DDP with the plain gather.
The lost terms are the push each sample gets as a negative in the other ranks' rows. The default
temperature here is tau = 1, a soft softmax in which every negative pushes about equally, so those
terms are a large share of the gradient (the lesson prints how large). Measured at the defaults
(N = 240, 150 Adam steps, lr 0.01, seeds 0, 1, 2, in one process with the detached-blocks loss):
held-out retrieval accuracy 39.6%, 38.9%, 37.1% with the true gradient, 2-3 points lower in every
seed at P = 2, 4-6 lower at P = 3 and 4-7 lower at P = 4; the final loss is higher in every seed too.
At a sharp temperature (tau = 0.1) the harm shrinks to a slightly higher loss, with accuracy even a
little higher: the wrong gradient is a different optimisation, not a guaranteed failure, which is why
a lesson checks gradients against a reference instead of waiting for training to look wrong. A fix
comes in lesson 23. `--detached-at 8,16,48,240` trains with the plain gather's gradient at larger P in
one process.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from distlab.contrastive.losses import clip_loss
from distlab.contrastive.reference import DetachedBlocks, full_batch_gradients
from distlab.contrastive.report import detached_at_table, method_table, relative_errors, seeds_table
from distlab.contrastive.step import first_step_gradients, wrap_ddp
from distlab.contrastive.training import (
    OPTIMIZERS,
    TrainConfig,
    TrainData,
    batch_schedule,
    retrieval_accuracy,
    train_ddp,
    train_single_process,
)
from distlab.contrastive.variants import LOCAL_PLAIN
from distlab.processes.console import print0
from distlab.processes.flags import check_flags_against_world, divides_global_batch, positive_int
from distlab.processes.identity import Runtime
from distlab.processes.runtime import distributed, run_main
from distlab.proof.cli import add_contrastive_args, add_optimizer_args, lesson_parser
from distlab.proof.compare import compare, compare_whole, comparison_table, tolerances
from distlab.proof.models import TwoTower, paired_data
from distlab.proof.verdict import Verdict

DTYPE = torch.float64
SINGLE, PLAIN = "one process", "plain"


# ---- the chapter, part by part -------------------------------------------------------------------


def world_sizes(text: str) -> tuple[int, ...]:
    """--detached-at's value: world sizes separated by commas, each a positive integer."""
    sizes = tuple(positive_int(part) for part in text.split(","))
    return tuple(dict.fromkeys(sizes))


def parse_args():
    parser = add_contrastive_args(lesson_parser(__doc__), global_batch=240, tau=1.0)
    parser.add_argument("--seeds", type=positive_int, default=3, help="training seeds: --seed, --seed + 1, ...")
    parser.add_argument("--train-size", type=positive_int, default=4096, help="training pairs (at least N)")
    add_optimizer_args(parser, steps=150, lr=0.01, optimizer="each run's")
    parser.add_argument("--held-out", type=positive_int, default=512, help="held-out pairs for retrieval accuracy")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="adam", help="optimizer of every run")
    parser.add_argument("--eval-every", type=positive_int, default=10, help="steps between accuracy checks")
    parser.add_argument(
        "--detached-at",
        type=world_sizes,
        default=(),
        metavar="P1,P2,...",
        help="also train with the plain gather's loss at these world sizes, each run in one "
        "process (each must divide N; e.g. 8,16,48)",
    )
    args = parser.parse_args()
    if args.global_batch > args.train_size:
        parser.error(f"argument --global-batch: N = {args.global_batch} is more than --train-size {args.train_size}")
    if any(args.global_batch % q for q in args.detached_at):
        parser.error(
            f"argument --detached-at: every size must divide --global-batch {args.global_batch}, "
            f"got {','.join(map(str, args.detached_at))}"
        )
    return args


def first_step(rt: Runtime, args, verdict: Verdict) -> None:
    """One step's gradient with the plain gather, against the full batch and the detached blocks."""
    world, n = rt.world_size, args.global_batch
    ddp = first_step_gradients(rt, (LOCAL_PLAIN,), n, args.tau, seed=args.seed, dtype=DTYPE)
    model, (x, y) = TwoTower(seed=args.seed, dtype=DTYPE), paired_data(n, seed=args.seed, dtype=DTYPE)
    ref_loss, ref = full_batch_gradients(model, x, y, 1 / args.tau)
    _, detached = full_batch_gradients(model, x, y, 1 / args.tau, loss_fn=DetachedBlocks(world))
    plain = ddp[LOCAL_PLAIN.name][1]
    errors = {"ref": compare_whole(ref, plain), "detached": compare_whole(detached, plain)}
    rtol, atol = tolerances(DTYPE)
    print0(
        method_table(
            [
                (LOCAL_PLAIN.name, "ref", errors["ref"], world == 1),
                (LOCAL_PLAIN.name, "detached", errors["detached"], True),
            ],
            "DDP gradients after one step",
            caption=f"ref: the single-process full batch; detached: the same with every other "
            f"block's embeddings detached in each block's rows; allclose: rtol {rtol:g}, atol {atol:g}",
        )
    )
    print0(comparison_table(compare(ref, plain), "plain gather, per parameter, vs ref", expect_match=world == 1))
    lost = lost_fraction(model, x, y, args.tau, world)
    print0(
        f"lost at the embeddings (the s != r terms): ||dL/dZ - plain|| / ||dL/dZ|| = "
        f"{lost['z_x']:.1%} for z_x, {lost['z_y']:.1%} for z_y",
        highlight=False,
    )
    loss = ddp[LOCAL_PLAIN.name][0]
    print0(f"loss L: reference {ref_loss:.12f}; plain {loss:.12f}", highlight=False)
    verdict.check(
        "the forward pass is right: the loss equals the reference's",
        abs(loss - ref_loss) <= atol + rtol * abs(ref_loss),
    )
    verdict.check(
        "the plain gather's gradient " + ("differs from" if world > 1 else "equals (P = 1)") + " the full batch's",
        errors["ref"].ok == (world == 1),
        f"max rel err {errors['ref'].max_rel:.2e}, cosine {errors['ref'].cosine:.4f}",
    )
    verdict.check(
        "the plain gather's gradient is the detached-blocks gradient",
        errors["detached"].ok,
        f"max rel err {errors['detached'].max_rel:.1e}",
    )
    verdict.figure("relative_error", {"plain": relative_errors(ref, plain)})
    verdict.figure("lost_fraction", lost)


def lost_fraction(model: TwoTower, x: torch.Tensor, y: torch.Tensor, tau: float, world: int) -> dict[str, float]:
    """At the embeddings, per tower: ||dL/dZ - plain's dZ|| / ||dL/dZ||, the share of the gradient lost."""
    with torch.no_grad():
        z = model(x, y)
    grads = {}
    for name, loss_fn in (("true", clip_loss), ("plain", DetachedBlocks(world))):
        a, b = (t.clone().requires_grad_() for t in z)
        loss_fn(a, b, 1 / tau).backward()
        grads[name] = (a.grad, b.grad)
    return {
        tower: ((grads["true"][i] - grads["plain"][i]).norm() / grads["true"][i].norm()).item()
        for i, tower in enumerate(("z_x", "z_y"))
    }


def seed_data(args, seed: int, device) -> TrainData:
    """Seed `seed`'s training pairs, held-out pairs and global batches (the model: TwoTower(seed=seed))."""
    train, held_out = (
        tuple(t.to(device) for t in paired_data(size, seed=s, dtype=DTYPE))
        for size, s in ((args.train_size, seed), (args.held_out, seed + 1000))
    )
    return TrainData(train, held_out, batch_schedule(args.train_size, args.global_batch, args.steps, seed=seed))


def training(rt: Runtime, args, config: TrainConfig, verdict: Verdict) -> None:
    """Per seed, one process (the ranks share those runs round-robin) and DDP with the plain gather."""
    seeds = [args.seed + k for k in range(args.seeds)]
    mine = {
        s: train_single_process(
            TwoTower(seed=s, dtype=DTYPE).to(rt.device),
            seed_data(args, s, rt.device),
            config,
            label=f"{SINGLE}, seed {s}",
        )
        for s in seeds[rt.rank :: rt.world_size]
    }
    every = [None] * rt.world_size
    dist.all_gather_object(every, mine)
    runs = {s: {SINGLE: part[s]} for part in every for s in part}
    for s in seeds:
        model = wrap_ddp(TwoTower(seed=s, dtype=DTYPE), rt)
        runs[s][PLAIN] = train_ddp(rt, model, LOCAL_PLAIN, seed_data(args, s, rt.device), config, f"{PLAIN}, seed {s}")
    runs = dict(sorted(runs.items()))
    print0(seeds_table(runs, args.held_out))
    worse = sum(r[PLAIN].accuracies[-1] < r[SINGLE].accuracies[-1] for r in runs.values())
    higher = sum(r[PLAIN].final_loss > r[SINGLE].final_loss for r in runs.values())
    print0(
        f"the plain gather ended with lower held-out accuracy in {worse} of {len(runs)} seeds and a higher "
        f"final loss in {higher} of {len(runs)}",
        highlight=False,
    )
    verdict.figure(
        "runs",
        {
            s: {
                k: {
                    "losses": r.losses,
                    "final_loss": r.final_loss,
                    "eval_steps": r.eval_steps,
                    "accuracies": r.accuracies,
                }
                for k, r in pair.items()
            }
            for s, pair in runs.items()
        },
    )


def train_detached_at(rt: Runtime, args, data: TrainData, config: TrainConfig, verdict: Verdict) -> None:
    """Train with the detached-blocks loss for each --detached-at P in one process: what DDP with the plain
    gather computes (the tests prove it equal for P <= 4), at world sizes this machine cannot run.
    The ranks share the work round-robin."""
    mine = {}
    for q in args.detached_at[rt.rank :: rt.world_size]:
        run = train_single_process(
            TwoTower(seed=args.seed, dtype=DTYPE).to(rt.device), data, config, loss_fn=DetachedBlocks(q)
        )
        mine[q] = {"final_loss": run.final_loss, "accuracy": run.accuracies[-1]}
    every = [None] * rt.world_size
    dist.all_gather_object(every, mine)
    results = {q: r for part in every for q, r in part.items()}
    print0(detached_at_table(results, args.global_batch))
    verdict.figure("detached_at", results)


def main() -> int:
    args = check_flags_against_world(parse_args(), divides_global_batch)
    with distributed(args.device) as rt:
        verdict, world, n = Verdict(rt), rt.world_size, args.global_batch
        print0(
            f"[bold]Lesson 22: local x global, plain all_gather[/] - N = {n} pairs, P = {world}, C = {n // world}, "
            f"tau = {args.tau}, float64, {rt.backend}",
            highlight=False,
        )
        first_step(rt, args, verdict)

        data = seed_data(args, args.seed, rt.device)
        config = TrainConfig(args.tau, args.optimizer, args.lr, args.eval_every)
        start = verdict.figure(
            "start_accuracy", retrieval_accuracy(TwoTower(seed=args.seed, dtype=DTYPE).to(rt.device), *data.held_out)
        )
        print0(
            f"\n[bold]Training[/]: {args.seeds} seed(s), {args.steps} steps of N = {n} pairs from {args.train_size}, "
            f"{args.optimizer} lr {args.lr}; held-out accuracy before training {start:.2%} (seed {args.seed})",
            highlight=False,
        )
        training(rt, args, config, verdict)
        if args.detached_at:
            train_detached_at(rt, args, data, config, verdict)
        verdict.figure("global_batch", n)
        return verdict.finish(args.json)


if __name__ == "__main__":
    run_main(main)
