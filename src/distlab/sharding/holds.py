"""What one training step holds on one rank of plain data parallelism, item by item, measured.

The model states (weights, gradients, AdamW's moments and step counts, and under mixed precision the
float32 master copy) are counted from the storages of the tensors that hold them after the step; the
activations are what autograd saves for backward (a saved-tensor hook sees every one; parameters it
saves are not counted again); the peak is `PeakMemory`'s over building the model and one step.

Mixed precision here is the classic recipe written out: bf16 weights compute forward and backward, a
float32 master copy of the weights is what AdamW steps (its moments float32 too), and the updated
master is rounded into the bf16 weights. The float32 gradient exists only during the step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

from distlab.memory import PeakMemory
from distlab.sharding.training import storage_bytes


@dataclass(frozen=True)
class Holding:
    items: dict[str, int]  # bytes by item, "activations" included
    peak: int  # PeakMemory's peak over building the model and one step


def saved_bytes(model: nn.Module, forward: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, int]:
    """(forward(), bytes of the distinct storages autograd saved for backward, parameters excluded)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with saved_tensors_hooks(pack, lambda t: t):
        loss = forward()
    return loss, sum(seen.values())


def _states(params: list[torch.Tensor], optimizer: torch.optim.Optimizer) -> dict[str, list[torch.Tensor]]:
    state = [optimizer.state[p] for p in optimizer.param_groups[0]["params"]]
    return {
        "weights": params,
        "gradients": [p.grad for p in params],
        "moments": [st[k] for st in state for k in ("exp_avg", "exp_avg_sq")],
        "step counts": [st["step"] for st in state],
    }


def plain_step(build: Callable[[], nn.Module], x: torch.Tensor, target: torch.Tensor) -> Holding:
    """One AdamW step in the model's own dtype."""
    with PeakMemory() as mem:
        model = build()
        optimizer = torch.optim.AdamW(model.parameters(), weight_decay=0.1)
        loss, activations = saved_bytes(model, lambda: F.mse_loss(model(x), target))
        loss.backward()
        optimizer.step()
    items = {k: storage_bytes(v) for k, v in _states(list(model.parameters()), optimizer).items()}
    return Holding(items | {"activations": activations}, mem.peak_bytes)


def mixed_step(build: Callable[[], nn.Module], x: torch.Tensor, target: torch.Tensor) -> Holding:
    """One step of bf16 compute with a float32 master copy that AdamW steps."""
    with PeakMemory() as mem:
        model = build().to(torch.bfloat16)
        params = list(model.parameters())
        master = [nn.Parameter(p.detach().float()) for p in params]
        optimizer = torch.optim.AdamW(master, weight_decay=0.1)
        loss, activations = saved_bytes(model, lambda: F.mse_loss(model(x.bfloat16()), target.bfloat16()))
        loss.backward()
        for m, p in zip(master, params):
            m.grad = p.grad.float()
        optimizer.step()
        with torch.no_grad():
            for m, p in zip(master, params):
                p.copy_(m)  # rounded to bf16: the next forward's weights
                m.grad = None  # the float32 gradient is needed only for the step
    items = {k: storage_bytes(v) for k, v in _states(params, optimizer).items()}
    return Holding(items | {"master copy": storage_bytes(master), "activations": activations}, mem.peak_bytes)
