"""What lesson 10's checks run: the batch, the loss, a few SGD steps of a split block, and the reference's.

The batch is N sequences of seq tokens of width d (`distlab.proof.models.token_batch`), rank r holding sequences
r C .. (r+1) C - 1; the loss of a rank is MSE(z, target) + alpha L_aux on its rows, a mean, so with equal
shares the step's loss is the mean of the ranks' (and its gradient the mean of theirs: DDP's average).

The reference (`one_process_run`) is a deep copy of the whole `MoEBlock`, every expert in it, trained on the
whole batch in one process with plain autograd (`distlab.proof.reference.one_process`); `decisions` is its
routing of the whole batch, with what its capacity rule keeps, counted per rank and expert.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from distlab.layer_split.expert_parallel.moe import MoEBlock, MoEConfig, Routing, capacity, kept_choices, route
from distlab.processes.identity import Runtime
from distlab.proof.compare import Comparison, compare_whole
from distlab.proof.models import token_batch
from distlab.proof.reference import one_process, sgd
from distlab.proof.training import Plain, Run, mean_over_ranks, train


@dataclass(frozen=True)
class Problem:
    """N sequences of seq tokens, drawn from `seed`; `steps` SGD steps at `lr`."""

    n: int
    seq: int
    seed: int
    steps: int = 1
    lr: float = 0.1

    def rows(self, rank: int, world: int) -> slice:
        share = self.n // world
        return slice(rank * share, (rank + 1) * share)

    def batch(self, dim: int, rows: slice = slice(None)) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, target) of the sequences in `rows` (all by default), float64."""
        x, target = token_batch(self.n, self.seq, dim, seed=self.seed + 1)
        return x[rows], target[rows]


def loss_of(out: tuple[torch.Tensor, torch.Tensor], target: torch.Tensor, alpha: float) -> torch.Tensor:
    """MSE(z, target) + alpha L_aux, for a block's output (z, L_aux)."""
    z, aux = out
    return F.mse_loss(z, target) + alpha * aux


def split_run(
    rt: Runtime, block: nn.Module, cfg: MoEConfig, problem: Problem, sync: Callable[[], None]
) -> tuple[Run, torch.Tensor]:
    """`problem.steps` SGD steps of a split `block` on this rank's rows, `sync()` after every backward:
    (the Run, its losses the means over ranks; step 1's output rows)."""
    x, target = (t.to(rt.device) for t in problem.batch(cfg.dim, problem.rows(rt.rank, rt.world_size)))
    first = []

    def step(k: int) -> torch.Tensor:
        out = block(x)
        first.append(out[0].detach().cpu())
        loss = loss_of(out, target, cfg.aux_weight)
        loss.backward()
        return loss

    run = train(Plain(block, sgd(problem.lr)(block.parameters()), sync), step, problem.steps)
    run.losses = mean_over_ranks(run.losses, rt)  # each rank's mean; equal shares: their mean is the step's
    return run, first[0]


def one_process_run(cfg: MoEConfig, problem: Problem) -> tuple[Run, torch.Tensor]:
    """The reference: (its Run, step 1's output on the whole batch)."""
    x, target = problem.batch(cfg.dim)
    block = MoEBlock(cfg)
    run = one_process(
        block, lambda k: (x, target), lambda out, t: loss_of(out, t, cfg.aux_weight), sgd(problem.lr), problem.steps
    )
    return run, block(x)[0].detach()


@dataclass(frozen=True)
class Decisions:
    """The reference's routing of the whole batch (at the start), and what its capacity rule keeps."""

    routing: Routing
    kept: torch.Tensor  # (N seq, kappa) booleans
    kept_counts: torch.Tensor  # (P, E): tokens of rank s kept by expert i
    routed_counts: torch.Tensor  # (P, E): tokens of rank s that chose expert i


def decisions(cfg: MoEConfig, problem: Problem, world: int) -> Decisions:
    block = MoEBlock(cfg)
    with torch.no_grad():
        _, u = block.tokens(problem.batch(cfg.dim)[0])
        routing = route(block.moe.router, u, cfg.top_k)
    kept = kept_choices(routing, capacity(cfg, len(u)))
    share = len(u) // world
    ranks = [slice(s * share, (s + 1) * share) for s in range(world)]

    def counts(mask: torch.Tensor) -> torch.Tensor:
        return torch.stack([torch.bincount(routing.chosen[r][mask[r]], minlength=cfg.experts) for r in ranks])

    return Decisions(routing, kept, counts(kept), counts(torch.ones_like(kept)))


PARTS = {  # the block's parameters by part, by name
    "router": lambda name: name.startswith("moe.router"),
    "experts": lambda name: ".experts." in name,
    "attn+LN": lambda name: not name.startswith("moe."),
}


def relative(diff: Comparison, reference: dict[str, torch.Tensor]) -> float:
    """max |a - r| / max |r| over a whole group of tensors (a tensor whose reference is ~0, attention's key
    bias, whose gradient vanishes, counts at the group's scale, not its own)."""
    return diff.max_abs / max(t.abs().max().item() for t in reference.values())


def differences(ref: Run, ref_z: torch.Tensor, run: Run, z: torch.Tensor) -> tuple[list[float], bool]:
    """A split run against the reference, on this rank's share: the relative difference (`relative`) of
    step 1's output, of step 1's gradients part by part (`PARTS`), of the parameters after the last step and
    of the losses; and whether every tensor is allclose at float64's tolerance."""
    groups = [({"z": ref_z}, {"z": z})]
    for pick in PARTS.values():
        names = [n for n in run.first_grads if pick(n)]  # this rank's: the replicated weights and its experts
        groups.append(({n: ref.first_grads[n] for n in names}, {n: run.first_grads[n] for n in names}))
    groups.append(({n: ref.params[n] for n in run.params}, run.params))
    groups.append(({"loss": torch.tensor(ref.losses)}, {"loss": torch.tensor(run.losses)}))
    diffs = [(compare_whole(want, got), want) for want, got in groups]
    return [relative(d, want) for d, want in diffs], all(d.ok for d, _ in diffs)
