"""Training the two-tower model for a fixed number of steps, single-process or under DDP, and
measuring what it learned (lesson 22's three runs).

All runs see the same data: a training set of `paired_data` pairs, and at step t the same global
batch of N pairs drawn from it (`batch_schedule`, a seeded generator; rank r takes rows
r*C ... r*C + C - 1). They start from the same weights and use the same optimizer, so the runs differ
only in the gradient they step with.

`retrieval_accuracy` is top-1 retrieval on held-out pairs (drawn with another seed from the same
"world"): the fraction of x_i whose nearest z_y is y_i, averaged with the y -> x direction. Chance is
1 / (number of held-out pairs).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from distlab.contrastive.batch import local_block
from distlab.contrastive.losses import clip_loss
from distlab.contrastive.reference import LossFn
from distlab.contrastive.step import ddp_step
from distlab.contrastive.variants import Variant
from distlab.processes.console import progress
from distlab.processes.identity import Runtime
from distlab.proof.compare import params_of

OPTIMIZERS = ("sgd", "adam")
FINAL_STEPS = 10  # a run's final loss is the mean of L over this many last steps


@dataclass(frozen=True)
class TrainConfig:
    """How every run of a comparison trains: the same tau, optimizer, learning rate and evaluations."""

    tau: float
    optimizer: str = "adam"  # one of OPTIMIZERS
    lr: float = 0.01
    eval_every: int = 10  # held-out accuracy after every this many steps, and after the last


@dataclass(frozen=True)
class TrainData:
    """What every run of a comparison sees: the training pairs, the held-out pairs, and the global
    batch (indices into the training pairs) of every step."""

    train: tuple[torch.Tensor, torch.Tensor]
    held_out: tuple[torch.Tensor, torch.Tensor]
    batches: list[torch.Tensor]


@dataclass
class TrainRun:
    losses: list[float] = field(default_factory=list)  # the global loss L at every step
    eval_steps: list[int] = field(default_factory=list)  # steps after which accuracy was measured
    accuracies: list[float] = field(default_factory=list)  # held-out top-1 retrieval accuracy
    params: dict[str, torch.Tensor] = field(default_factory=dict)  # after the last step

    @property
    def final_loss(self) -> float:
        """The run's final loss: L averaged over its last FINAL_STEPS steps (one step's L is one
        batch's, and batches differ)."""
        last = self.losses[-FINAL_STEPS:]
        return sum(last) / len(last)


@torch.no_grad()
def retrieval_accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Mean of x -> y and y -> x top-1 retrieval accuracy among the given pairs."""
    was_training = model.training
    model.eval()
    z_x, z_y = model(x, y)
    model.train(was_training)
    s = z_x @ z_y.T
    target = torch.arange(len(x), device=x.device)
    return ((s.argmax(1) == target).double().mean() + (s.argmax(0) == target).double().mean()).item() / 2


def batch_schedule(n_train: int, batch_size: int, steps: int, seed: int) -> list[torch.Tensor]:
    """The global batch (indices into the training set) of every step: epochs of seeded permutations."""
    if not 1 <= batch_size <= n_train:
        raise ValueError(f"the batch size must be between 1 and the training set size {n_train}, got {batch_size}")
    gen = torch.Generator().manual_seed(seed)
    per_epoch = n_train // batch_size
    batches: list[torch.Tensor] = []
    while len(batches) < steps:
        order = torch.randperm(n_train, generator=gen)
        batches.extend(order[i * batch_size : (i + 1) * batch_size] for i in range(per_epoch))
    return batches[:steps]


def make_optimizer(name: str, params, lr: float) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr)
    raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {name!r}")


def _train(
    model: nn.Module,
    eval_model: nn.Module,
    step_fn: Callable[[torch.Tensor], float],
    data: TrainData,
    config: TrainConfig,
    label: str | None,
) -> TrainRun:
    """The one loop: zero_grad, the caller's step (forward, loss, backward), optimizer step, and
    held-out accuracy every `eval_every` steps. With a `label`, progress is shown on rank 0."""
    optimizer = make_optimizer(config.optimizer, model.parameters(), config.lr)
    run = TrainRun()
    batches = data.batches if label is None else progress(data.batches, len(data.batches), label)
    for step, idx in enumerate(batches):
        optimizer.zero_grad(set_to_none=True)
        run.losses.append(step_fn(idx))
        optimizer.step()
        if (step + 1) % config.eval_every == 0 or step + 1 == len(data.batches):
            run.eval_steps.append(step + 1)
            run.accuracies.append(retrieval_accuracy(eval_model, *data.held_out))
    run.params = params_of(eval_model)
    return run


def train_single_process(
    model: nn.Module, data: TrainData, config: TrainConfig, loss_fn: LossFn = clip_loss, label: str | None = None
) -> TrainRun:
    """The reference run: a deep copy of `model`, the whole global batch, plain autograd on
    `loss_fn(z_x, z_y, s)` with s = 1/tau (clip_loss; lesson 22 passes the detached-blocks loss to see what the
    plain gather does at a P this machine cannot run)."""
    model = copy.deepcopy(model)
    x, y = data.train

    def step_fn(idx: torch.Tensor) -> float:
        loss = loss_fn(*model(x[idx], y[idx]), 1 / config.tau)
        loss.backward()
        return loss.item()

    return _train(model, model, step_fn, data, config, label)


def train_ddp(
    rt: Runtime, ddp_model: nn.Module, variant: Variant, data: TrainData, config: TrainConfig, label: str | None = None
) -> TrainRun:
    """The same steps under DDP: each rank takes its C rows of every global batch, `variant` computes
    the loss and DDP averages the gradients. Every rank ends with the same weights (and measures the
    same accuracy)."""
    x, y = data.train

    def step_fn(idx: torch.Tensor) -> float:
        local = local_block(idx, rt)
        return ddp_step(rt, ddp_model, x[local], y[local], config.tau, variant)

    return _train(ddp_model, ddp_model.module, step_fn, data, config, label)
