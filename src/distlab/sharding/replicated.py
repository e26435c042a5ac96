"""The baseline every ZeRO stage is measured against: data parallelism with whole model states on
every rank, gradients averaged by one ring all-reduce per layer (the same padded flat units as ZeRO,
so the bytes compare), torch's AdamW on the whole model. A trainee of the one training loop."""

from __future__ import annotations

import torch
from torch import nn

from distlab.comm.ring import Ring
from distlab.held import model_states
from distlab.runtime import Runtime
from distlab.sharding.flat import units_of
from distlab.sharding.problem import ShardingConfig, adamw
from distlab.training import Plain


class Replicated(Plain):
    def __init__(self, model: nn.Module, rt: Runtime, cfg: ShardingConfig):
        super().__init__(model, adamw(model.parameters(), cfg))
        self.rt, self.ring = rt, Ring()
        self.units = units_of(model, rt.rank, rt.world_size)

    def after_backward(self) -> None:
        for unit, layer in zip(self.units, self.model.children()):
            grads = [p.grad for p in layer.parameters()]
            mean = self.ring.all_reduce(unit.flatten(grads)) / self.rt.world_size
            for g, new in zip(grads, unit.unflatten(mean)):
                g.copy_(new)

    def items(self) -> dict[str, list[torch.Tensor]]:
        params = list(self.model.parameters())
        return model_states(params, [p.grad for p in params], [self.optimizer.state[p] for p in params])
