"""One split run against the unsplit reference: the same starting weights, data and masks; the unsplit
layer trained in one process on the whole batch with plain autograd, the split one on this rank; then
its output, every gradient and the parameters after the last step compared with the reference's, cut
as this rank's parameters are cut.

Parts: "mlp", "attention" (x straight in, no dropout) and "block" (LayerNorms, dropout masks,
residuals). Under sequence parallelism the rank gets its sequence part of x, the target and the masks.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.distributed as dist

from distlab.comm.ledger import Ledger
from distlab.compare import GradientError, all_ok, compare, gradient_error
from distlab.memory import PeakMemory
from distlab.tensor_parallel.blocks import ParallelAttention, ParallelBlock, ParallelMLP
from distlab.tensor_parallel.layers import reference_shards
from distlab.tensor_parallel.model import BlockConfig, build, dropout_masks
from distlab.tensor_parallel.operators import Comm
from distlab.tensor_parallel.sequence import reduce_sequence_parallel_grads, seq_part
from distlab.tensor_parallel.training import Batch, Run, train

PARTS = {
    "mlp": (lambda b: b.mlp, ParallelMLP),
    "attention": (lambda b: b.attn, ParallelAttention),
    "block": (lambda b: b, ParallelBlock),
}


@dataclass(frozen=True)
class Outcome:
    """A split run against the reference: output, step-1 gradients, parameters after the last step
    and every step's loss; the bytes this rank sent."""

    output: bool
    grads: GradientError
    grads_max_abs: float  # the largest |a - r| over every gradient
    params: bool
    losses: bool
    ledger: Ledger  # what this rank's operators sent
    run: Run  # this rank's run: its output, gradients and parameters in our layout

    @property
    def ok(self) -> bool:
        return self.output and self.grads.ok and self.params and self.losses


def reference_run(cfg: BlockConfig, part: str, steps: int, lr: float) -> Run:
    block, x, target = build(cfg)
    masks = [dropout_masks(cfg, s) for s in range(steps)] if part == "block" else None
    x.requires_grad_()  # dL/dx is checked too: the gradient the layer before would receive
    return train(copy.deepcopy(PARTS[part][0](block)), Batch(x, target, x.numel(), masks), steps, lr)


def rank_batch(cfg: BlockConfig, part: str, comm: Comm, steps: int, device: torch.device) -> Batch:
    """This rank's batch: everything under tensor parallelism, its sequence part under sequence parallelism."""
    _, x, target = build(cfg)
    masks = [dropout_masks(cfg, s) for s in range(steps)] if part == "block" else None
    rank, p = dist.get_rank(comm.group), dist.get_world_size(comm.group)
    mine = (lambda t: seq_part(t, rank, p).to(device)) if comm.sequence_parallel else (lambda t: t.to(device))
    if masks is not None:
        masks = [None if m is None else tuple(mine(t) for t in m) for m in masks]
    return Batch(mine(x).requires_grad_(), mine(target), x.numel(), masks)


def split_module(cfg: BlockConfig, part: str, comm: Comm, device: torch.device):
    rank, p = dist.get_rank(comm.group), dist.get_world_size(comm.group)
    return PARTS[part][1](PARTS[part][0](build(cfg)[0]), rank, p, comm).to(device)


def split_run(rt, cfg: BlockConfig, part: str, comm: Comm, steps: int, lr: float) -> Outcome:
    """`part` split over comm's group with comm's operators, `steps` SGD steps, against the reference."""
    model = split_module(cfg, part, comm, rt.device)
    run = train(
        model,
        rank_batch(cfg, part, comm, steps, rt.device),
        steps,
        lr,
        lambda: reduce_sequence_parallel_grads(model, comm),
    )
    ref = reference_run(cfg, part, steps, lr)
    rank, p = dist.get_rank(comm.group), dist.get_world_size(comm.group)
    cut = (lambda t: seq_part(t, rank, p)) if comm.sequence_parallel else (lambda t: t)
    expected = reference_shards(ref.first_grads, model, rank, p) | {"input": cut(ref.first_grads["input"])}
    losses = torch.tensor(run.losses, dtype=torch.float64, device=rt.device)
    if comm.sequence_parallel:  # each rank holds its tokens' share of the loss: add them for the report
        dist.all_reduce(losses, group=comm.group)
    return Outcome(
        output=all_ok(compare({"z": cut(ref.first_output)}, {"z": run.first_output})),
        grads=gradient_error(expected, run.first_grads),
        grads_max_abs=max(row.max_abs for row in compare(expected, run.first_grads)),
        params=all_ok(compare(reference_shards(ref.params, model, rank, p), run.params)),
        losses=torch.allclose(losses.cpu(), torch.tensor(ref.losses, dtype=torch.float64), rtol=1e-10, atol=0),
        ledger=comm.ledger,
        run=run,
    )


def same_runs(ours: Run, theirs: Run) -> bool:
    """Two runs of the same split (ours, torch's): output, step-1 gradients, final parameters."""
    return (
        all_ok(compare({"z": ours.first_output}, {"z": theirs.first_output}))
        and all_ok(compare(ours.first_grads, theirs.first_grads))
        and all_ok(compare(ours.params, theirs.params))
    )


def activation_bytes_measured(rt, cfg: BlockConfig, comm: Comm) -> tuple[int, int]:
    """(saved, peak) bytes of one block's forward on this rank. saved: the distinct storages autograd
    saves for backward (parameters and inputs not counted) plus the output: what stays alive until
    backward. peak: `PeakMemory`'s peak of the forward's allocations, temporaries included (its live
    count at the end is not used: gloo releases a collective's buffers from its own thread, a little
    later or not, so it varies from run to run)."""
    model = split_module(cfg, "block", comm, rt.device)
    batch = rank_batch(cfg, "block", comm, 1, rt.device)
    x = batch.x.detach()
    known = {t.untyped_storage().data_ptr() for t in (x, *batch.masks[0], *model.parameters())}
    saved = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in known:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with PeakMemory() as mem, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x, batch.masks[0])
    return sum(saved.values()) + out.untyped_storage().nbytes(), mem.peak_bytes


def block_costs(rt, cfg: BlockConfig) -> dict[str, tuple[float, int, bool]]:
    """For TP and TP + SP, one step of the block on this rank: (bytes sent, activation bytes kept,
    equal to the unsplit block) - what the notebook plots against P."""
    from distlab.tensor_parallel.operators import sequence_parallel, tensor_parallel

    out = {}
    for name, make in (("TP", tensor_parallel), ("TP + SP", sequence_parallel)):
        outcome = split_run(rt, cfg, "block", make(), 1, 0.5)
        out[name] = (float(outcome.ledger.sent), activation_bytes_measured(rt, cfg, make())[0], outcome.ok)
    return out
