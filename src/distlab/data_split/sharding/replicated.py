"""The baseline every ZeRO stage is measured against: data parallelism with whole model states on
every rank, gradients averaged by one ring all-reduce per layer (the same padded flat units as ZeRO,
so the bytes compare), torch's AdamW on the whole model. A trainee of the one training loop. At construction
every rank takes rank 0's parameters and buffers (`broadcast_model`); the units are ZeRO's (`units_of`: the
root's own and tied parameters in the root's unit, each tensor once, frozen ones in none), and a unit that got
no gradient on every rank (a branch not taken) keeps none, as in one process.

Under mixed precision (`cfg.master`) the bf16 gradients are all-reduced and AdamW steps a whole float32
master copy of the weights (`distlab.data_split.sharding.mixed.stepping_a_master`): 2 + 2 + 4 + 8 = 16 Psi bytes."""

from __future__ import annotations

import torch
from torch import nn

from distlab.comm.ring import Ring
from distlab.data_split.sharding.flat import units_of
from distlab.data_split.sharding.mixed import states_by_name, stepping_a_master
from distlab.data_split.sharding.problem import ShardingConfig, optimizer_of
from distlab.data_split.sharding.shards import broadcast_model, no_gradient
from distlab.processes.identity import Runtime
from distlab.proof.held import model_states
from distlab.proof.training import Plain, Tensors


class Replicated(Plain):
    def __init__(self, model: nn.Module, rt: Runtime, cfg: ShardingConfig):
        broadcast_model(model)
        params = list(model.parameters())
        self.masters = []  # none in one dtype: AdamW steps the weights themselves
        if cfg.master is None:
            super().__init__(model, optimizer_of(params, cfg))
        else:
            optimizer, self.masters = stepping_a_master(params, cfg.master, lambda ps: optimizer_of(ps, cfg))
            super().__init__(model, optimizer)
        self.stepped = dict(zip([n for n, _ in model.named_parameters()], self.masters or params))
        self.rt, self.ring = rt, Ring()
        self.units = units_of(model, rt.rank, rt.world_size)

    def zero_grad(self) -> None:
        self.model.zero_grad(set_to_none=True)

    def after_backward(self) -> None:
        for unit in self.units:
            grads = [p.grad for p in unit.params]
            if no_gradient(unit, grads):
                continue
            mean = self.ring.all_reduce(unit.flatten(grads)) / self.rt.world_size
            for g, new in zip(grads, unit.unflatten(mean)):
                g.copy_(new)

    def params(self) -> Tensors:  # what AdamW stepped: under mixed precision the master, by the weights' names
        return {name: t.detach().clone() for name, t in self.stepped.items()}

    def states(self) -> dict[str, Tensors]:
        return states_by_name(self.optimizer, self.stepped)

    def items(self) -> dict[str, list[torch.Tensor]]:
        params = [p for unit in self.units for p in unit.params]
        states = [self.optimizer.state[t] for t in self.stepped.values() if t.requires_grad]
        held = model_states(params, [p.grad for p in params], states)
        return held | ({"master copy": self.masters} if self.masters else {})
