"""ZeRO-1, -2 and -3 over the flat units of `distlab.sharding.flat`, every byte sent through a
counting ring (`distlab.comm.ring.Ring`). Lesson 07 writes each stage out in a few lines;
these are the same mechanisms as classes the loop in `distlab.sharding.training` drives:

    zero_grad(); loss.backward(); after_backward(); optimizer.step(); after_step()

- `Zero1` (optimizer states sharded): every rank keeps the whole model and gets the whole gradient
  from backward; after backward each layer's flat gradient is reduce-scattered (rank r receives
  shard r of the sum, divided by P: the mean), AdamW steps rank r's shard of the weights, and the
  updated shards are all-gathered back into the weights.
- `Zero2` (gradients sharded too): the same, but each layer's reduce-scatter runs from a hook the
  moment backward has produced that layer's gradients, and the whole gradients are freed at once.
- `Zero3` (weights sharded too): the model holds no weights between layers' uses. A forward
  pre-hook all-gathers a layer's weights just before it runs, a forward hook frees them after; its
  saved-tensor hooks keep no gathered weight for backward but a note of where it was, and backward
  all-gathers the layer again when it needs it. The all-gather's backward is the reduce-scatter.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from distlab.comm.ring import Ring
from distlab.runtime import Runtime
from distlab.sharding.flat import FlatUnit, units_of
from distlab.sharding.problem import ShardingConfig, adamw


class Sharded:
    """What every stage shares: the units, this rank's shard of each (an nn.Parameter that AdamW
    steps), the ring that counts bytes, and the gathers the checks use (not counted)."""

    def __init__(self, model: nn.Module, rt: Runtime, cfg: ShardingConfig):
        self.model, self.rt, self.ring = model, rt, Ring()
        self.units = units_of(model, rt.rank, rt.world_size)
        self.layers = list(model.children())
        self.shards = [
            nn.Parameter(u.my_shard(u.flatten([p.detach() for p in layer.parameters()])).clone())
            for u, layer in zip(self.units, self.layers)
        ]
        self.optimizer = adamw(self.shards, cfg)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.model.zero_grad(set_to_none=True)

    def after_backward(self) -> None:
        pass

    def after_step(self) -> None:
        pass

    def _reduce_scatter(self, unit: FlatUnit, layer: nn.Module, shard: nn.Parameter) -> None:
        """shard.grad = this rank's shard of the layer's gradient, averaged over the ranks."""
        shard.grad = self.ring.reduce_scatter(unit.flatten([p.grad for p in layer.parameters()])) / self.rt.world_size

    def _gather_weights(self) -> None:
        with torch.no_grad():
            for unit, layer, shard in zip(self.units, self.layers, self.shards):
                for p, new in zip(layer.parameters(), unit.unflatten(self.ring.all_gather(shard.detach()))):
                    p.copy_(new)

    def full(self, tensors: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every unit's shards of `tensors` (one per unit) gathered whole, by parameter name (CPU)."""
        out = {}
        for unit, t in zip(self.units, tensors):
            whole = t.new_empty(unit.padded)
            dist.all_gather_single(whole, t.detach().contiguous())
            out.update({k: v.cpu().clone() for k, v in unit.named(whole).items()})
        return out

    def full_params(self) -> dict[str, torch.Tensor]:
        return self.full(list(self.shards))

    def full_grads(self) -> dict[str, torch.Tensor]:
        return self.full([s.grad for s in self.shards])

    def items(self) -> dict[str, list[torch.Tensor]]:
        """The tensors this rank holds, by item of `distlab.sharding.accounting.held`."""
        state = [self.optimizer.state[s] for s in self.shards]
        weights = list(self.model.parameters())
        grads = [p.grad for p in weights + self.shards if p.grad is not None]
        copy = {"shard copy": list(self.shards)} if weights else {}
        return {
            "weights": weights or list(self.shards),
            "gradients": grads,
            **copy,
            "moments": [st[k] for st in state for k in ("exp_avg", "exp_avg_sq")],
            "step counts": [st["step"] for st in state],
        }

    def full_states(self) -> dict[str, dict[str, torch.Tensor]]:
        """AdamW's state of every parameter, from the shards (m and v gathered; the step count)."""
        state = [self.optimizer.state[s] for s in self.shards]
        m = self.full([st["exp_avg"] for st in state])
        v = self.full([st["exp_avg_sq"] for st in state])
        step = {name: st["step"].cpu().clone() for st, u in zip(state, self.units) for name in u.names}
        return {name: {"exp_avg": m[name], "exp_avg_sq": v[name], "step": step[name]} for name in m}


class Zero1(Sharded):
    def after_backward(self) -> None:
        for unit, layer, shard in zip(self.units, self.layers, self.shards):
            self._reduce_scatter(unit, layer, shard)

    def after_step(self) -> None:
        self._gather_weights()


class Zero2(Sharded):
    def __init__(self, model: nn.Module, rt: Runtime, cfg: ShardingConfig):
        super().__init__(model, rt, cfg)
        for i, layer in enumerate(self.layers):
            for p in layer.parameters():
                p.register_post_accumulate_grad_hook(lambda p, i=i: self._grad_ready(i))
        self.waiting = [len(list(layer.parameters())) for layer in self.layers]

    def _grad_ready(self, i: int) -> None:
        self.waiting[i] -= 1
        if self.waiting[i] == 0:  # the layer's whole gradient is in: shard it, free the whole one
            self._reduce_scatter(self.units[i], self.layers[i], self.shards[i])
            for p in self.layers[i].parameters():
                p.grad = None
            self.waiting[i] = len(list(self.layers[i].parameters()))

    def after_step(self) -> None:
        self._gather_weights()


class _Gather(torch.autograd.Function):
    """Forward: all-gather a unit's shards into its whole flat weights. Backward: reduce-scatter the
    whole flat gradient, divided by P: this rank's shard of the averaged gradient."""

    @staticmethod
    def forward(ctx, shard: torch.Tensor, stage: Zero3, i: int) -> torch.Tensor:
        ctx.stage, ctx.i = stage, i
        return stage.ring.all_gather(shard.detach())

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        stage = ctx.stage
        stage.regathered.pop(ctx.i, None)  # the layer's backward is over: free its weights
        return stage.ring.reduce_scatter(grad.contiguous()) / stage.rt.world_size, None, None


class Zero3(Sharded):
    def __init__(self, model: nn.Module, rt: Runtime, cfg: ShardingConfig):
        super().__init__(model, rt, cfg)
        self.regathered: dict[int, torch.Tensor] = {}
        self.places = [
            [
                (mod, name)
                for mod_name, mod in layer.named_modules()
                for name, _ in list(mod.named_parameters(recurse=False))
            ]
            for layer in self.layers
        ]
        for i, layer in enumerate(self.layers):
            for mod, name in self.places[i]:
                del mod._parameters[name]  # the whole weights are gone; the shard is all that is left
                setattr(mod, name, None)
            layer.register_forward_pre_hook(lambda m, args, i=i: self._gather(i))
            layer.register_forward_hook(lambda m, args, out, i=i: self._free(i))

    def _gather(self, i: int) -> None:
        self.whole = _Gather.apply(self.shards[i], self, i)
        for (mod, name), view in zip(self.places[i], self.units[i].unflatten(self.whole)):
            setattr(mod, name, view)
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack(i), self._unpack(i))
        self.hooks.__enter__()

    def _free(self, i: int) -> None:
        self.hooks.__exit__(None, None, None)
        for mod, name in self.places[i]:
            setattr(mod, name, None)
        self.whole = None  # nothing else refers to the gathered weights: freed here

    def _pack(self, i: int):
        ptr = self.whole.untyped_storage().data_ptr()

        def pack(t: torch.Tensor):
            if t.untyped_storage().data_ptr() != ptr:
                return t  # an activation: kept as usual
            return (t.shape, t.stride(), t.storage_offset())  # a gathered weight: keep only where it was

        return pack

    def _unpack(self, i: int):
        def unpack(saved):
            if isinstance(saved, torch.Tensor):
                return saved
            if i not in self.regathered:  # the first use in this layer's backward: all-gather again
                self.regathered[i] = self.ring.all_gather(self.shards[i].detach())
            return self.regathered[i].as_strided(*saved)

        return unpack


STAGE_CLASSES = {"ZeRO-1": Zero1, "ZeRO-2": Zero2, "ZeRO-3": Zero3}
