"""Lesson 01: naive model parallelism. The layers are split across ranks; send/recv carry the
activations forward and their gradients back.

    torchrun --nproc-per-node 2 lessons/01_model_parallel.py     # any P from 1 to the layer count

The idea. A model too big for one device is cut into P contiguous stages, one per rank. Rank p
computes A_p = f_p(A_{p-1}) and sends A_p to rank p+1; the last rank computes the loss L. A tensor
that crosses a process boundary arrives as plain numbers, without its graph, so rank p+1 marks
what it received `requires_grad_()`: its backward then yields dL/dA_p, which it sends back, and rank
p resumes the backward from it (`A_p.backward(dL/dA_p)`). That is the chain rule across the cut
(theta_p: the parameters of stage p):

    dL/dtheta_p = dL/dA_p * dA_p/dtheta_p     and     dL/dA_{p-1} = dL/dA_p * dA_p/dA_{p-1}, sent on to p-1.

Every parameter lives on one rank, so each rank steps its own optimizer and no gradient is averaged.

The mechanism is `model_parallel_step` below: the whole send/recv chain, in this file. The
split is `distlab/model_split/partition.py: stage_bounds`: the first (layers mod P) stages get one layer
more. (The tempting `per_rank = ceil(layers / P); start = rank * per_rank` leaves the trailing ranks
empty: 6 layers on P = 4 ranks gives 2, 2, 2, 0.) The training loop is the track's one loop,
`distlab/model_split/training.py: train`.

The proof. An unsplit deep copy of the model trains on the whole batch in one process; every rank
compares its stage's gradients (after step 1) and parameters (after the last step) with the copy's,
and the loss, the mean squared error over the whole batch, with the copy's loss. The spans each rank
records show that only one rank computes at any instant: the others wait in `recv`. Lesson 02 fills
that idle time with micro-batches.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F

from distlab.model_split.partition import boundary_shapes, split_stages
from distlab.model_split.report import per_tensor
from distlab.model_split.training import PipelineConfig, check_config, problem, train, unsplit_reference
from distlab.processes.console import print0
from distlab.processes.flags import check_flags_against_world, positive_int
from distlab.processes.identity import Runtime
from distlab.processes.runtime import distributed, run_main
from distlab.proof.cli import add_mlp_args, lesson_parser, mlp_run, stages_fit_layers
from distlab.proof.timeline import Timeline, busy_fractions, max_concurrency, render
from distlab.proof.verdict import Verdict

# ---- the mechanism: layers split across ranks, send/recv forward, gradients back -----------------


def model_parallel_step(
    stage: torch.nn.Module, x: torch.Tensor, target: torch.Tensor, shapes: list, span=lambda kind: nullcontext()
) -> float | None:
    """Stage p = this rank: receive A_{p-1} (rank 0 starts from the batch x), compute A_p, send it on;
    then receive dL/dA_p (the last rank: from the loss), back-propagate, send dL/dA_{p-1} back.
    `shapes[p]` is the shape of A_{p-1}; `span(kind)` times the compute. Returns L on the last rank."""
    p, last = dist.get_rank(), dist.get_world_size() - 1
    # Forward: receive A_{p-1} (rank 0 starts from the batch), compute A_p, send it on.
    if p == 0:
        a_in = x
    else:
        a_in = torch.empty(shapes[p], dtype=x.dtype, device=x.device)
        dist.recv(a_in, src=p - 1)
        a_in.requires_grad_()  # a leaf: its .grad will be dL/dA_{p-1}
    with span("F"):
        a_out = stage(a_in)
    if p < last:
        dist.send(a_out.detach(), dst=p + 1)
    # Backward: the last rank starts from the loss, the others from dL/dA_p sent back by p+1.
    if p == last:
        with span("I"):
            loss = F.mse_loss(a_out, target)
            loss.backward()
    else:
        grad_out = torch.empty_like(a_out)
        dist.recv(grad_out, src=p + 1)
        with span("I"):
            a_out.backward(grad_out)
    if p > 0:
        dist.send(a_in.grad, dst=p - 1)
    return loss.item() if p == last else None


class ModelParallelStep:
    """One step of naive model parallelism on this rank: the whole batch down the stages and back."""

    def __init__(self, rt: Runtime, cfg: PipelineConfig):
        check_config(cfg)
        model, self.x, self.target = problem(cfg)
        every = split_stages(model, rt.world_size)
        # Every rank derives every cut's shape (and checks the batch fits) before any message.
        self.shapes = boundary_shapes(every, tuple(self.x.shape), cfg.dtype)
        self.stages, self.rt, self.timeline = [every[rt.rank]], rt, Timeline(rt.rank, rt.device)
        self.stages[0].module.to(rt.device)

    def __call__(self, step: int) -> float | None:
        dev = self.rt.device
        return model_parallel_step(
            self.stages[0].module,
            self.x.to(dev),
            self.target.to(dev),
            self.shapes,
            lambda kind: self.timeline.span(kind, step),
        )

    def measurements(self) -> dict:
        return {}


# ---- the chapter, part by part -------------------------------------------------------------------


def parse_args(argv: list[str] | None = None):
    parser = add_mlp_args(lesson_parser(__doc__), layers=8, width=256, global_batch=512, steps=5)
    parser.add_argument(
        "--input-features",
        type=positive_int,
        default=16,
        help="features per row; anything but 16 shows the 'does not fit' error",
    )
    return parser.parse_args(argv)


def main() -> int:
    args = check_flags_against_world(parse_args(), stages_fit_layers)
    cfg = PipelineConfig(**mlp_run(args), input_features=args.input_features)
    with distributed(args.device) as rt:
        verdict = Verdict(rt)
        print0(
            f"[bold]Lesson 01: naive model parallelism[/] - {args.layers} layers on {rt.world_size} "
            f"rank(s), N={args.global_batch} rows, {args.steps} SGD steps, {args.dtype}, {rt.backend}"
        )
        run = train(rt, cfg, ModelParallelStep(rt, cfg))
        ref = unsplit_reference(cfg)
        tables, matched = per_tensor(run, ref, cfg.dtype)
        print0(*tables)
        print0("loss per step, split:   " + " ".join(f"{v:.6f}" for v in run.losses))
        print0("loss per step, unsplit: " + " ".join(f"{v:.6f}" for v in ref.losses))
        verdict.check("every stage's gradients, parameters and the losses equal the unsplit model's", matched)

        # Step 1 pays one-off costs (first connections, allocations); draw the last, steady step.
        last = [s for s in run.spans if s.step == args.steps - 1]
        busy = busy_fractions(last, rt.world_size)
        print0(f"\n[bold]Who computes when in step {args.steps}[/] (F forward, I backward, . waiting in recv):")
        print0(render(last, rt.world_size))
        print0("busy fraction per rank: " + ", ".join(f"rank {r} {f:.0%}" for r, f in enumerate(busy)))
        peak = verdict.figure("most_ranks_computing_at_once", max_concurrency(run.spans))
        verdict.check("one rank computes at a time", peak == 1, f"at most {peak} at any instant")
        verdict.figure("busy_fractions", busy)
        verdict.figure("spans", [vars(s) for s in last])
        return verdict.finish(args.json)


if __name__ == "__main__":
    run_main(main)
