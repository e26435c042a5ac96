"""The same block under torch's own tensor parallelism: `parallelize_module` on a `DeviceMesh`.

torch 2.13 (`torch.distributed.tensor.parallel`) turns each parameter into a DTensor with a placement on
the mesh: `ColwiseParallel` gives a Linear's weight and bias `Shard(0)` (our column chunks),
`RowwiseParallel` its weight `Shard(1)` and its bias `Replicate()`; `SequenceParallel` keeps a
LayerNorm's parameters `Replicate()` and runs it on activations placed `Shard(1)` (cut along the
sequence); `PrepareModuleInput` redistributes a module's input from `Shard(1)` to `Replicate()` (the
all-gather, f-bar). The collectives are derived from the placements by DTensor, not written: every
ColwiseParallel layer carries its own "identity forward, all-reduce backward", so q, k and v reduce
their input gradients separately (three all-reduces where ours, one f before all three, needs one);
under SequenceParallel the LayerNorms' gradients stay `Partial(sum)` after backward and are all-reduced
when the optimizer reads them, one tensor at a time. `CommDebugMode` counts what it launches.
"""

from __future__ import annotations

import warnings
from dataclasses import replace

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from distlab.layer_split.tensor_parallel.model import build, regression_loss
from distlab.layer_split.tensor_parallel.operators import sequence_parallel as sequence_parallel_ops
from distlab.layer_split.tensor_parallel.operators import tensor_parallel as tensor_parallel_ops
from distlab.layer_split.tensor_parallel.runs import LayerBatch, rank_batch, sgd_steps
from distlab.proof.training import Run


def plan(sequence_parallel: bool) -> dict:
    """The parallelize plan of `distlab.proof.models.Block`: q, k, v, fc1 column-wise, out and fc2 row-wise; with
    sequence parallelism the LayerNorms on sequence parts and the two gathers before the column layers."""
    tp = {
        "attn.q": ColwiseParallel(),
        "attn.k": ColwiseParallel(),
        "attn.v": ColwiseParallel(),
        "attn.out": RowwiseParallel(),
        "mlp.fc1": ColwiseParallel(),
        "mlp.fc2": RowwiseParallel(),
    }
    if not sequence_parallel:
        return tp
    gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return tp | {
        "ln1": SequenceParallel(use_local_output=True),
        "ln2": SequenceParallel(use_local_output=True),
        "attn": gather,
        "mlp": gather,
        "attn.out": RowwiseParallel(output_layouts=Shard(1)),
        "mlp.fc2": RowwiseParallel(output_layouts=Shard(1)),
    }


def parallelize(block: nn.Module, mesh: DeviceMesh, sequence_parallel: bool) -> nn.Module:
    return parallelize_module(block, mesh, plan(sequence_parallel))


def local(tensor: torch.Tensor, placements) -> torch.Tensor:
    """A DTensor as this rank's part in our layout (a Partial gradient summed first); else as is."""
    if not isinstance(tensor, DTensor):
        return tensor.detach().clone()
    return tensor.redistribute(placements=placements).to_local().detach().clone()


def comm_counts(model: nn.Module, batch: LayerBatch) -> dict[str, dict[str, int]]:
    """The collectives torch launches in one forward, its backward and an SGD step (gradients zeroed)."""
    counts = {}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0, foreach=False)  # (see runs._Layer)
    with CommDebugMode() as mode:
        loss = regression_loss(model(batch.x), batch.target, batch.count)
    counts["forward"] = mode.get_comm_counts()
    with CommDebugMode() as mode, warnings.catch_warnings():
        # torch's module hooks warn that x needs no gradient; true, and irrelevant here.
        warnings.simplefilter("ignore", UserWarning)
        loss.backward()
    counts["backward"] = mode.get_comm_counts()
    with CommDebugMode() as mode:
        optimizer.step()
    counts["optimizer step"] = mode.get_comm_counts()
    optimizer.zero_grad(set_to_none=True)
    return {phase: {_name(op): n for op, n in c.items()} for phase, c in counts.items()}


def _name(op) -> str:
    """c10d_functional.all_gather_into_tensor -> all_gather, as our operators name them."""
    return str(op).split(".")[-1].removesuffix("_into_tensor").removesuffix("_tensor")


def placements_of(model: nn.Module) -> dict[str, str]:
    """Each parameter's placement, e.g. {"attn.q.weight": "Shard(dim=0)", "ln1.weight": "-"}."""
    return {
        n: ", ".join(map(str, p.placements)) if isinstance(p, DTensor) else "-" for n, p in model.named_parameters()
    }


def torch_run(rt, cfg, sequence_parallel: bool, steps: int, lr: float) -> tuple[Run, dict, dict]:
    """`steps` SGD steps of the block under parallelize_module on a 1-D mesh of every rank, dropout off
    (torch's dropout draws its own masks): (the run in our layout, collectives counted, placements)."""
    from torch.distributed.device_mesh import init_device_mesh

    cfg = replace(cfg, dropout=0.0)
    mesh = init_device_mesh(rt.device.type, (rt.world_size,), mesh_dim_names=("tp",))
    layout = (sequence_parallel_ops if sequence_parallel else tensor_parallel_ops)()  # where the data goes
    batch = rank_batch(cfg, "block", layout, steps, rt.device)
    model = parallelize(build(cfg)[0].to(rt.device), mesh, sequence_parallel)
    counts = comm_counts(model, replace(batch, x=batch.x.detach()))
    placements = {n: p.placements for n, p in model.named_parameters() if isinstance(p, DTensor)}
    run = sgd_steps(model, batch, steps, lr, ours=lambda name, t: local(t, placements.get(name)))
    return run, counts, placements_of(model)
