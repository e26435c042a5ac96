"""This rank's shard of every layer, and AdamW on the shards: what each ZeRO stage of lesson 07 starts from.

At construction every rank takes rank 0's parameters and buffers (one broadcast each, as torch's DDP does), so
ranks that built the model from different seeds start as one model. Each layer is one flat unit
(`distlab.data_split.sharding.flat`: the trainable parameters a child alone holds; the root's unit holds the model's own
and the tied ones; frozen parameters are no unit's and stay whole): its Psi_u parameters flattened and padded to
P ceil(Psi_u / P) elements; rank r keeps shard r of it as an nn.Parameter, and AdamW steps the shards
only, so AdamW's moments are sharded from the start. Every byte a stage sends goes through a counting
ring (`Ring`); the gathers that read a run whole for the record (`grads`, `params`, `states`) are not
counted: they are the check's, not the stage's.

A stage is this object with its two hooks set (lesson 07 writes ZeRO-1, -2 and -3 that way); the one
training loop (`distlab.proof.training.train`) drives it:

    zero_grad(); loss.backward(); after_backward(); optimizer.step(); after_step()

Under mixed precision (`cfg.master`) the shards are bf16 like the weights (what the stages gather, and
where their reduce-scatters leave the gradient), and AdamW steps a float32 master of each shard
(`distlab.data_split.sharding.mixed.stepping_a_master`), rounded into the shard after each step: the stages are
the same code in both.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from distlab.comm import compat
from distlab.comm.ring import Ring
from distlab.data_split.sharding.flat import units_of
from distlab.data_split.sharding.mixed import stepping_a_master
from distlab.data_split.sharding.problem import ShardingConfig, optimizer_of
from distlab.processes.identity import Runtime
from distlab.proof.held import model_states


def broadcast_model(model: nn.Module, group=None) -> None:
    """The parameters and buffers of the group's first rank on every rank of `group` (None: all), in place
    (every tensor once: a tied weight is one)."""
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            dist.broadcast(t, group=group, group_src=0)


def no_gradient(unit, parts: list) -> bool:
    """True if none of the unit's parameters got a gradient this step (a branch not taken: the unit is left
    as one process leaves it, with no gradient, and the optimizer skips it); a unit with some and not others
    is refused, naming them: its shard is stepped as one tensor, so it cannot skip part of itself. Every rank
    must take the same branches (as under FSDP2): ZeRO-3's gathers and ZeRO-2's reduce-scatters run from the
    modules that run, so ranks that disagree would pair different collectives."""
    if all(g is None for g in parts):
        return True
    missing = [name for name, g in zip(unit.names, parts) if g is None]
    if missing:
        raise RuntimeError(
            f"{missing} got no gradient this step but the rest of their unit did; a unit is stepped whole: "
            "use every parameter of a layer in a step, or none"
        )
    return False


class Sharded:
    """The layers' flat units, this rank's shard of each (an nn.Parameter that AdamW steps), the ring
    that counts bytes, and the readouts of the whole run (gathered, not counted)."""

    def __init__(self, model: nn.Module, rt: Runtime, cfg: ShardingConfig):
        self.model, self.rt, self.ring = model, rt, Ring()
        broadcast_model(model)  # construction, not a step: not counted by the ring
        self.units = units_of(model, rt.rank, rt.world_size)
        self.shards = [nn.Parameter(u.my_shard(u.flatten([p.detach() for p in u.params])).clone()) for u in self.units]
        self.whole_weights = True  # ZeRO-1 and -2 keep them beside the shards; ZeRO-3 sets False
        self.frozen = {n: p for n, p in model.named_parameters() if not p.requires_grad}  # whole, never stepped
        self.masters = []  # none in one dtype: AdamW steps the shards themselves
        if cfg.master is None:
            self.optimizer = optimizer_of(self.shards, cfg)
        else:
            self.optimizer, self.masters = stepping_a_master(self.shards, cfg.master, lambda ps: optimizer_of(ps, cfg))
        self.stepped = self.masters or self.shards  # what AdamW steps and keeps moments of

    def zero_grad(self) -> None:
        for shard in self.shards:
            shard.grad = None
        self.model.zero_grad(set_to_none=True)

    def after_backward(self) -> None:
        pass

    def after_step(self) -> None:
        pass

    def _whole(self, tensors: list[torch.Tensor | None]) -> dict[str, torch.Tensor]:
        """Every unit's shards of `tensors` (one per unit; None: zeros) gathered whole, by parameter name (CPU)."""
        out = {}
        for unit, shard, t in zip(self.units, self.shards, tensors):
            t = torch.zeros_like(shard) if t is None else t
            whole = t.new_empty(unit.padded)
            compat.all_gather_single(whole, t.detach().contiguous())
            out.update({k: v.cpu().clone() for k, v in unit.named(whole).items()})
        return out

    def params(self) -> dict[str, torch.Tensor]:
        """Every parameter by name: the units' gathered from what the optimizer steps, the frozen as held."""
        return self._whole(list(self.stepped)) | {n: p.detach().cpu().clone() for n, p in self.frozen.items()}

    def grads(self) -> dict[str, torch.Tensor]:
        return self._whole([s.grad for s in self.shards])

    def states(self) -> dict[str, dict[str, torch.Tensor]]:
        """The optimizer's state of every trainable parameter, from the shards: a state shaped like the shard
        (AdamW's moments, SGD's momentum) gathered, a scalar (AdamW's step count) as it is; a unit never
        stepped (no gradient yet) has none, as in one process."""
        out = {}
        for unit, stepped in zip(self.units, self.stepped):
            state = self.optimizer.state[stepped]
            for name in unit.names:
                out[name] = {}
            for key, value in sorted(state.items()):
                if value.shape == stepped.shape:
                    whole = value.new_empty(unit.padded)
                    compat.all_gather_single(whole, value.detach().contiguous())
                    for name, part in unit.named(whole).items():
                        out[name][key] = part.cpu().clone()
                else:
                    for name in unit.names:
                        out[name][key] = value.cpu().clone()
        return out

    def items(self) -> dict[str, list[torch.Tensor]]:
        """The tensors this rank holds, by item of `distlab.data_split.sharding.accounting.held`: ZeRO-1 and -2 keep
        the whole weights beside the shards AdamW steps (the "shard copy"); ZeRO-3's shards are its weights;
        under mixed precision each stage keeps the float32 masters of its shards too (the "master copy")."""
        weights = [p for u in self.units for p in u.params if self.whole_weights]
        grads = [p.grad for p in weights + self.shards]
        held = model_states(weights or self.shards, grads, [self.optimizer.state[s] for s in self.stepped])
        held |= {"shard copy": list(self.shards)} if weights else {}
        return held | ({"master copy": self.masters} if self.masters else {})
