"""What one training step holds on one rank of plain data parallelism, item by item, measured.

The model states (weights, gradients, AdamW's moments and step counts, and under mixed precision the
float32 master copy) are counted from the storages of the tensors that hold them after the step; the
activations are what autograd saves for backward (`distlab.proof.held.SavedActivations`, by storage;
parameters it saves are not counted again); the peak is `PeakMemory`'s over building the model and one
step. Both counts follow `distlab.proof.held`'s one rule: each storage once.

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

from distlab.proof.held import SavedActivations, model_states, storage_bytes
from distlab.proof.memory import PeakMemory


@dataclass(frozen=True)
class Holding:
    items: dict[str, int]  # bytes by item, "activations" included
    peak: int  # PeakMemory's peak over building the model and one step


def _held(params: list[torch.Tensor], optimizer: torch.optim.Optimizer) -> dict[str, int]:
    states = [optimizer.state[p] for p in optimizer.param_groups[0]["params"]]
    return {k: storage_bytes(v) for k, v in model_states(params, [p.grad for p in params], states).items()}


def measure_one_dtype_step(build: Callable[[], nn.Module], x: torch.Tensor, target: torch.Tensor) -> Holding:
    """One AdamW step in the model's own dtype, measured (its formula: `accounting.expected_states_one_dtype`)."""
    with PeakMemory() as mem:
        model = build()
        optimizer = torch.optim.AdamW(model.parameters(), weight_decay=0.1)
        with SavedActivations(exclude=model.parameters()) as saved:
            loss = F.mse_loss(model(x), target)
        loss.backward()
        optimizer.step()
    return Holding(_held(list(model.parameters()), optimizer) | {"activations": saved.nbytes}, mem.peak_bytes)


def measure_mixed_step(build: Callable[[], nn.Module], x: torch.Tensor, target: torch.Tensor) -> Holding:
    """One step of bf16 compute with a float32 master copy that AdamW steps, measured (its formula:
    `accounting.expected_states_mixed`)."""
    with PeakMemory() as mem:
        model = build().to(torch.bfloat16)
        params = list(model.parameters())
        master = [nn.Parameter(p.detach().float()) for p in params]
        optimizer = torch.optim.AdamW(master, weight_decay=0.1)
        with SavedActivations(exclude=params) as saved:
            loss = F.mse_loss(model(x.bfloat16()), target.bfloat16())
        loss.backward()
        for m, p in zip(master, params):
            m.grad = p.grad.float()
        optimizer.step()
        with torch.no_grad():
            for m, p in zip(master, params):
                p.copy_(m)  # rounded to bf16: the next forward's weights
                m.grad = None  # the float32 gradient is needed only for the step
    items = _held(params, optimizer) | {"master copy": storage_bytes(master), "activations": saved.nbytes}
    return Holding(items, mem.peak_bytes)
