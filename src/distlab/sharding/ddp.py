"""The baseline every ZeRO stage is measured against: data parallelism with whole model states on
every rank, gradients averaged by one ring all-reduce per layer (the same padded flat units as ZeRO,
so the bytes compare), torch's AdamW on the whole model."""

from __future__ import annotations

import torch
from torch import nn

from distlab.comm.ring import Ring
from distlab.runtime import Runtime
from distlab.sharding.flat import units_of
from distlab.sharding.problem import ShardingConfig, adamw, optimizer_states


class Replicated:
    def __init__(self, model: nn.Module, rt: Runtime, cfg: ShardingConfig):
        self.model, self.rt, self.ring = model, rt, Ring()
        self.units = units_of(model, rt.rank, rt.world_size)
        self.optimizer = adamw(model.parameters(), cfg)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def after_backward(self) -> None:
        for unit, layer in zip(self.units, self.model.children()):
            grads = [p.grad for p in layer.parameters()]
            mean = self.ring.all_reduce(unit.flatten(grads)) / self.rt.world_size
            for g, new in zip(grads, unit.unflatten(mean)):
                g.copy_(new)

    def after_step(self) -> None:
        pass

    def items(self) -> dict[str, list[torch.Tensor]]:
        params = list(self.model.parameters())
        state = [self.optimizer.state[p] for p in params]
        return {
            "weights": params,
            "gradients": [p.grad for p in params],
            "moments": [st[k] for st in state for k in ("exp_avg", "exp_avg_sq")],
            "step counts": [st["step"] for st in state],
        }

    def full_params(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().cpu().clone() for n, p in self.model.named_parameters()}

    def full_grads(self) -> dict[str, torch.Tensor]:
        return {n: p.grad.detach().cpu().clone() for n, p in self.model.named_parameters()}

    def full_states(self) -> dict[str, dict[str, torch.Tensor]]:
        return optimizer_states(self.model, self.optimizer)
