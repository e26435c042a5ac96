"""This rank's shard of every layer, and AdamW on the shards: what each ZeRO stage of lesson 07 starts from.

Each layer is one flat unit (`distlab.data_split.sharding.flat`): its Psi_u parameters flattened and padded to
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
from torch import nn

from distlab.comm.ring import Ring
from distlab.data_split.sharding.flat import units_of
from distlab.data_split.sharding.mixed import stepping_a_master
from distlab.data_split.sharding.problem import ShardingConfig, adamw
from distlab.processes import compat
from distlab.processes.runtime import Runtime
from distlab.proof.held import model_states


class Sharded:
    """The layers' flat units, this rank's shard of each (an nn.Parameter that AdamW steps), the ring
    that counts bytes, and the readouts of the whole run (gathered, not counted)."""

    def __init__(self, model: nn.Module, rt: Runtime, cfg: ShardingConfig):
        self.model, self.rt, self.ring = model, rt, Ring()
        self.units = units_of(model, rt.rank, rt.world_size)
        self.layers = list(model.children())
        self.shards = [
            nn.Parameter(u.my_shard(u.flatten([p.detach() for p in layer.parameters()])).clone())
            for u, layer in zip(self.units, self.layers)
        ]
        self.masters = []  # none in one dtype: AdamW steps the shards themselves
        if cfg.master is None:
            self.optimizer = adamw(self.shards, cfg)
        else:
            self.optimizer, self.masters = stepping_a_master(self.shards, cfg.master, lambda ps: adamw(ps, cfg))
        self.stepped = self.masters or self.shards  # what AdamW steps and keeps moments of

    def zero_grad(self) -> None:
        for shard in self.shards:
            shard.grad = None
        self.model.zero_grad(set_to_none=True)

    def after_backward(self) -> None:
        pass

    def after_step(self) -> None:
        pass

    def _whole(self, tensors: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every unit's shards of `tensors` (one per unit) gathered whole, by parameter name (CPU)."""
        out = {}
        for unit, t in zip(self.units, tensors):
            whole = t.new_empty(unit.padded)
            compat.all_gather_single(whole, t.detach().contiguous())
            out.update({k: v.cpu().clone() for k, v in unit.named(whole).items()})
        return out

    def params(self) -> dict[str, torch.Tensor]:
        return self._whole(list(self.stepped))

    def grads(self) -> dict[str, torch.Tensor]:
        return self._whole([s.grad for s in self.shards])

    def states(self) -> dict[str, dict[str, torch.Tensor]]:
        """AdamW's state of every parameter, from the shards (m and v gathered; the step count)."""
        state = [self.optimizer.state[s] for s in self.stepped]
        m = self._whole([st["exp_avg"] for st in state])
        v = self._whole([st["exp_avg_sq"] for st in state])
        step = {name: st["step"].cpu().clone() for st, u in zip(state, self.units) for name in u.names}
        return {name: {"exp_avg": m[name], "exp_avg_sq": v[name], "step": step[name]} for name in m}

    def items(self) -> dict[str, list[torch.Tensor]]:
        """The tensors this rank holds, by item of `distlab.data_split.sharding.accounting.held`: ZeRO-1 and -2 keep
        the whole weights beside the shards AdamW steps (the "shard copy"); ZeRO-3's shards are its weights;
        under mixed precision each stage keeps the float32 masters of its shards too (the "master copy")."""
        weights = list(self.model.parameters())
        grads = [p.grad for p in weights + self.shards]
        held = model_states(weights or self.shards, grads, [self.optimizer.state[s] for s in self.stepped])
        held |= {"shard copy": list(self.shards)} if weights else {}
        return held | ({"master copy": self.masters} if self.masters else {})
