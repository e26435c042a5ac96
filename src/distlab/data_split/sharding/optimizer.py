"""ZeRO-1 as it is usually taught: any torch.optim optimizer, its state sharded by whole parameters.

    optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3, betas=(0.9, 0.95))

Every rank holds every parameter and, after the data-parallel all-reduce (lesson 06), every averaged gradient.
Each parameter is owned by one rank (the trainable ones dealt out in order to the rank that owns the fewest
elements so far, the same on every rank); rank r's optimizer is `optimizer_class(its parameters, **kwargs)`, so
it keeps the state (AdamW's moments, SGD's momentum) of its parameters only, about 1/P of the whole. `step()`
steps them, then broadcasts each parameter from its owner, so every rank holds the whole stepped model again.
The optimizer is any class, with any hyper-parameters: each parameter is stepped whole, by the class's own
code, so it equals the unsharded optimizer whatever its update (element-wise or not). Frozen parameters are
no one's; a parameter without a gradient is skipped by its owner's optimizer, as torch's are.

Lesson 07 writes the other way, ZeRO's own: each layer flattened and cut into P equal shards, reduce-scatter
instead of all-reduce (`distlab.data_split.sharding.shards`, the lesson's `zero1`), which balances exactly and sends
less, but only works for an update that acts element by element (AdamW, SGD).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class ShardedOptimizer(torch.optim.Optimizer):
    """`optimizer_class` over the parameters this rank owns; `step()` steps them and broadcasts every parameter
    from its owner. `param_groups` are the whole model's (every parameter, as handed in); `local` is this rank's
    optimizer; `owner[p]` the rank that steps p."""

    def __init__(self, params, optimizer_class: type[torch.optim.Optimizer], **kwargs: Any):
        self.optimizer_class, self.kwargs = optimizer_class, kwargs
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.owner: dict[torch.Tensor, int] = {}
        self.load = [0] * self.world  # elements owned per rank, so far
        self.local: torch.optim.Optimizer | None = None
        super().__init__(params, kwargs)  # calls add_param_group for each group

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """The group joins the whole model's groups; its trainable parameters are dealt out to owners, and this
        rank's share joins its own optimizer as a group with the same options."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        mine = []
        for p in group["params"]:
            if p.requires_grad and p not in self.owner:
                self.owner[p] = min(range(self.world), key=lambda r: (self.load[r], r))
                self.load[self.owner[p]] += p.numel()
                if self.owner[p] == self.rank:
                    mine.append(p)
        options = {k: v for k, v in group.items() if k != "params"}
        local = {"params": mine, **options}
        if self.local is None:
            self.local = self.optimizer_class([local], **self.kwargs)
        else:
            self.local.add_param_group(local)

    @torch.no_grad()
    def step(self, closure=None):
        """This rank's parameters stepped, then every parameter broadcast from its owner."""
        loss = self.local.step(closure)
        for p, rank in self.owner.items():
            dist.broadcast(p, src=rank)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if set_to_none:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.zero_()

    def states_by_name(self, model: torch.nn.Module) -> dict[str, dict[str, torch.Tensor]]:
        """Every trainable parameter's optimizer state, by name, sent by its owner (for checks, on the CPU)."""
        out = {}
        for name, p in model.named_parameters():
            if p in self.owner:
                state = [{k: v.detach().cpu().clone() for k, v in self.local.state[p].items()}]
                dist.broadcast_object_list(state, src=self.owner[p])
                out[name] = state[0]
        return out
