"""Distributed checkpoints with `torch.distributed.checkpoint` (DCP): save FSDP2's sharded model and
optimizer at P ranks, load them at any P' (DCP reshards: every rank reads the pieces its new shards
cover), and continue with the same global batch order.

`get_state_dict(model, optimizer)` gives both state dicts keyed by parameter name (the optimizer's
too, not by position), their values DTensors that know how they are sharded; `dcp.save` has every rank
write its own shards plus one metadata file (rank 0) saying which piece of which tensor is where;
`dcp.load` fills a fresh model's state dict, sharded however that model is, from those pieces; and
`set_state_dict` puts them into the model and optimizer. Nothing is gathered on one rank.

Steps are numbered globally and step t trains on `global_batch(cfg, t)` whatever P is: a run resumed
at step t sees the batches an uninterrupted run sees. At the same P every reduction runs in the same
order, so the resumed run is bit-identical; at another P the ranks' sums are grouped differently and
the parameters agree to float64 rounding (1e-12 is asked).

The folder is staged and committed (`distlab.processes.committed`, on the ground floor): a save killed half-way
leaves no folder that loads, and a torn or damaged one is refused in one line naming the file.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh

from distlab.data_split.sharding.fsdp import Fsdp2
from distlab.data_split.sharding.problem import ShardingConfig, build_model
from distlab.data_split.sharding.training import local_rows, steps_of
from distlab.processes.committed import load_committed, save_committed
from distlab.processes.identity import Runtime
from distlab.proof.training import train


def fsdp_on(rt: Runtime, cfg: ShardingConfig, ranks: int) -> tuple[Fsdp2, Runtime]:
    """FSDP2 on the first `ranks` ranks (every rank must call: a mesh is made by all); the
    Runtime those ranks see (P' = `ranks`). Ranks outside it get (None, their Runtime)."""
    mesh = DeviceMesh(rt.device.type, list(range(ranks)))
    sub = dataclasses.replace(rt, world_size=ranks)
    if rt.rank >= ranks:
        return None, sub
    return Fsdp2(build_model(cfg).to(rt.device), sub, cfg, mesh=mesh), sub


def train_steps(rt: Runtime, cfg: ShardingConfig, strategy: Fsdp2, first: int, steps: int) -> dict[str, torch.Tensor]:
    """Steps first .. first + steps - 1 of the one loop, this rank's rows of each step's global batch;
    every parameter after them (CPU)."""
    return train(strategy, steps_of(strategy, local_rows(rt, cfg, first, steps)), steps).params


def save(path: str, strategy: Fsdp2) -> None:
    model, optim = get_state_dict(strategy.model, strategy.optimizer)
    group = _group(strategy)
    save_committed(
        path,
        lambda staging: dcp.save({"model": model, "optim": optim}, checkpoint_id=staging, process_group=group),
        group,
    )


def load(path: str, strategy: Fsdp2) -> None:
    """Into a fresh FSDP2 model and optimizer, sharded over however many ranks they live on."""
    model, optim = get_state_dict(strategy.model, strategy.optimizer)
    state = {"model": model, "optim": optim}
    group = _group(strategy)
    load_committed(path, lambda folder: dcp.load(state, checkpoint_id=folder, process_group=group), group)
    set_state_dict(strategy.model, strategy.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def _group(strategy: Fsdp2):
    return next(iter(strategy.model.parameters())).device_mesh.get_group()


@dataclasses.dataclass
class ResumeRun:
    """Every parameter after the last step (CPU): uninterrupted, resumed at P, resumed at P'."""

    uninterrupted: dict[str, torch.Tensor]
    same_p: dict[str, torch.Tensor]
    other_p: dict[str, torch.Tensor] | None  # None on ranks outside the P' ranks
    other_ranks: int


def save_and_resume(rt: Runtime, cfg: ShardingConfig, path: str, before: int, after: int) -> ResumeRun:
    """Train `before` steps at P and save; resume from the checkpoint at P and at P' = max(1, P // 2)
    for `after` more steps; and the uninterrupted `before + after` steps at P, to compare with."""
    world, p2 = rt.world_size, max(1, rt.world_size // 2)
    straight, _ = fsdp_on(rt, cfg, world)
    train_steps(rt, cfg, straight, 0, before)
    save(path, straight)  # reads the state, changes nothing: the run goes on
    uninterrupted = train_steps(rt, cfg, straight, before, after)
    same, _ = fsdp_on(rt, cfg, world)
    load(path, same)
    same_p = train_steps(rt, cfg, same, before, after)
    other, sub = fsdp_on(rt, cfg, p2)
    other_p = None
    if other is not None:
        load(path, other)
        other_p = train_steps(sub, cfg, other, before, after)
    return ResumeRun(uninterrupted, same_p, other_p, p2)
