"""One split run against the unsplit reference: the same starting weights, data and masks; the unsplit
layer trained in one process on the whole batch with plain autograd, the split one on this rank, both
by the one training loop (`distlab.proof.training.train`); then its output, every gradient and the parameters
after the last step compared with the reference's, cut as this rank's parameters are cut.

Parts: "mlp", "attention" (x straight in, no dropout) and "block" (LayerNorms, dropout masks,
residuals). Under sequence parallelism the rank gets its sequence part of x, the target and the masks.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from distlab.comm.ledger import Ledger
from distlab.layer_split.tensor_parallel.blocks import ParallelAttention, ParallelBlock, ParallelMLP
from distlab.layer_split.tensor_parallel.layers import LIBRARY_LAYERS, Layers, reference_shards
from distlab.layer_split.tensor_parallel.model import BlockConfig, build, dropout_masks, regression_loss
from distlab.layer_split.tensor_parallel.operators import Comm, sequence_parallel, tensor_parallel
from distlab.layer_split.tensor_parallel.sequence import reduce_sequence_parallel_grads, seq_part
from distlab.proof.compare import Comparison, against, all_ok
from distlab.proof.held import SavedActivations
from distlab.proof.memory import PeakMemory
from distlab.proof.training import Plain, Run, train

PARTS = {
    "mlp": (lambda b: b.mlp, ParallelMLP),
    "attention": (lambda b: b.attn, ParallelAttention),
    "block": (lambda b: b, ParallelBlock),
}


@dataclass(frozen=True)
class LayerBatch:
    """What a model sees: its x, its target, the element count of the WHOLE batch, and each step's
    masks (its part of them; None: no dropout)."""

    x: torch.Tensor
    target: torch.Tensor
    count: int
    masks: list | None  # None: the model takes x alone (the MLP, attention)


class _Layer(Plain):
    """The trainee of a split or unsplit layer: its gradients, and the input's when it has one (what
    the layer before would get); each read tensor in our layout (`ours`: torch's DTensors, lesson 08)."""

    def __init__(self, model: nn.Module, lr: float, sync: Callable[[], None] | None, batch: LayerBatch, ours=None):
        # One tensor at a time (foreach=False), as SGD does on the CPU by default: on CUDA its default is the
        # foreach kernels, which take all the parameters of a device in one call, and torch's tensor
        # parallelism leaves some of them plain tensors (the LayerNorms without sequence parallelism) beside
        # DTensors, a mix DTensor refuses ("got mixed torch.Tensor and DTensor").
        super().__init__(model, torch.optim.SGD(model.parameters(), lr=lr, foreach=False), sync)
        self.x, self.ours = batch.x, ours or (lambda name, t: t)

    def grads(self) -> dict[str, torch.Tensor]:
        grads = {n: self.ours(n, g) for n, g in super().grads().items()}
        return grads | ({"input": self.x.grad.clone()} if self.x.requires_grad else {})

    def params(self) -> dict[str, torch.Tensor]:
        return {n: self.ours(n, p) for n, p in super().params().items()}


def sgd_steps(
    model: nn.Module,
    batch: LayerBatch,
    steps: int,
    lr: float,
    sync: Callable[[], None] | None = None,
    ours: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
) -> Run:
    """`steps` SGD steps of the loss sum (z - t)^2 / (N seq d) on `batch`, the one loop; `sync` after
    backward: nothing for tensor parallelism (the operators already made every gradient whole), the
    sequence-cut parameters' all-reduce, a data-parallel all-reduce. Keeps step 1's output too."""
    outputs = []

    def step(k: int) -> torch.Tensor:
        out = model(batch.x) if batch.masks is None else model(batch.x, batch.masks[k])
        if k == 0:
            outputs.append(out.detach().clone())
        loss = regression_loss(out, batch.target, batch.count)
        loss.backward()
        return loss

    run = train(_Layer(model, lr, sync, batch, ours), step, steps)
    return dataclasses.replace(run, first_output=outputs[0].cpu())


@dataclass(frozen=True)
class Outcome:
    """A split run (this rank's output, gradients and parameters in our layout), the bytes it sent, and
    how far each part is from the reference's, cut as this rank's tensors are."""

    run: Run
    ledger: Ledger  # what this rank's operators sent
    against: dict[str, Comparison]  # output, gradients (the input's too), parameters, losses

    @property
    def ok(self) -> bool:
        return all_ok(self.against.values())


def reference(cfg: BlockConfig, part: str, steps: int, lr: float) -> Run:
    """The unsplit `part` (a deep copy) trained in one process on the whole batch, plain autograd."""
    block, x, target = build(cfg)
    masks = [dropout_masks(cfg, s) for s in range(steps)] if part == "block" else None
    x.requires_grad_()  # dL/dx is checked too: the gradient the layer before would receive
    return sgd_steps(copy.deepcopy(PARTS[part][0](block)), LayerBatch(x, target, x.numel(), masks), steps, lr)


def rank_batch(cfg: BlockConfig, part: str, comm: Comm, steps: int, device: torch.device) -> LayerBatch:
    """This rank's batch: everything under tensor parallelism, its sequence part under sequence parallelism."""
    _, x, target = build(cfg)
    masks = [dropout_masks(cfg, s) for s in range(steps)] if part == "block" else None
    rank, p = dist.get_rank(comm.group), dist.get_world_size(comm.group)
    mine = (lambda t: seq_part(t, rank, p).to(device)) if comm.sequence_parallel else (lambda t: t.to(device))
    if masks is not None:
        masks = [None if m is None else tuple(mine(t) for t in m) for m in masks]
    return LayerBatch(mine(x).requires_grad_(), mine(target), x.numel(), masks)


def split_module(cfg: BlockConfig, part: str, comm: Comm, device: torch.device, layers: Layers = LIBRARY_LAYERS):
    rank, world = dist.get_rank(comm.group), dist.get_world_size(comm.group)
    return PARTS[part][1](PARTS[part][0](build(cfg)[0]), rank, world, comm, layers).to(device)


def split_run(
    rt, cfg: BlockConfig, part: str, comm: Comm, steps: int, lr: float, layers: Layers = LIBRARY_LAYERS
) -> Outcome:
    """`part` split over comm's group with comm's operators and `layers`, `steps` SGD steps, against the
    reference."""
    model = split_module(cfg, part, comm, rt.device, layers)
    batch = rank_batch(cfg, part, comm, steps, rt.device)
    run = sgd_steps(model, batch, steps, lr, lambda: reduce_sequence_parallel_grads(model, comm))
    if comm.sequence_parallel:  # each rank holds its tokens' share of the loss: add them for the report
        losses = torch.tensor(run.losses, dtype=torch.float64, device=rt.device)
        dist.all_reduce(losses, group=comm.group)
        run = dataclasses.replace(run, losses=losses.tolist())
    return Outcome(run, comm.ledger, against(as_cut(reference(cfg, part, steps, lr), model, comm), run))


def as_cut(ref: Run, model: nn.Module, comm: Comm) -> Run:
    """The reference run cut as this rank's `model` is: each parallel layer's parameters (and their
    gradients) its chunk; under sequence parallelism the output and the input's gradient its part."""
    rank, p = dist.get_rank(comm.group), dist.get_world_size(comm.group)
    cut = (lambda t: seq_part(t, rank, p)) if comm.sequence_parallel else (lambda t: t)
    input_grad = {"input": cut(ref.first_grads["input"])} if "input" in ref.first_grads else {}
    return dataclasses.replace(
        ref,
        first_output=None if ref.first_output is None else cut(ref.first_output),
        first_grads=reference_shards(ref.first_grads, model, rank, p) | input_grad,
        params=reference_shards(ref.params, model, rank, p),
    )


def same_runs(ours: Run, theirs: Run) -> bool:
    """Two runs of the same split (ours, torch's): output, step-1 gradients, final parameters."""
    return all(c.ok for name, c in against(ours, theirs).items() if name != "losses")


def activation_bytes_measured(rt, cfg: BlockConfig, comm: Comm, layers: Layers = LIBRARY_LAYERS) -> tuple[int, int]:
    """(saved, peak) bytes of one block's forward on this rank. saved: what autograd saves for backward
    (`distlab.proof.held.SavedActivations`: by storage; parameters, the input and the masks exist anyway and
    are not counted) plus the output: what stays alive until backward. peak: `PeakMemory`'s peak of the
    forward's allocations, temporaries included (its live count at the end is not used: gloo releases a
    collective's buffers from its own thread, a little later or not, so it varies from run to run)."""
    model = split_module(cfg, "block", comm, rt.device, layers)
    batch = rank_batch(cfg, "block", comm, 1, rt.device)
    x = batch.x.detach()
    with PeakMemory() as mem, SavedActivations(exclude=[x, *batch.masks[0], *model.parameters()]) as saved:
        out = model(x, batch.masks[0])
    return saved.nbytes + out.untyped_storage().nbytes(), mem.peak_bytes


def block_costs(rt, cfg: BlockConfig) -> dict[str, tuple[float, int, bool]]:
    """For TP and TP + SP, one step of the block on this rank: (bytes sent, activation bytes kept,
    equal to the unsplit block) - what the notebook plots against P."""
    out = {}
    for name, make in (("TP", tensor_parallel), ("TP + SP", sequence_parallel)):
        outcome = split_run(rt, cfg, "block", make(), 1, 0.5)
        out[name] = (float(outcome.ledger.sent), activation_bytes_measured(rt, cfg, make())[0], outcome.ok)
    return out
