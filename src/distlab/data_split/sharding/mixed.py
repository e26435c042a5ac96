"""Mixed precision for lesson 07's strategies: bf16 weights and gradients, a float32 master that AdamW steps.

The recipe (the ZeRO paper's, Rajbhandari et al. section 3.1): forward and backward run in bf16, so the
weights and gradients a rank keeps are bf16 (2 bytes); AdamW steps a float32 copy of what it owns (the
master, 4 bytes) with float32 moments (8 bytes), and each step's result is rounded into the bf16 tensors:

    before AdamW's step   master.grad = grad in float32   (exists only during the step)
    AdamW's step          on the master, float32 moments
    after it              bf16 tensor <- master (rounded); master.grad = None

`stepping_a_master` hangs that on an optimizer's step hooks, so a strategy (DDP, ZeRO-1/2/3 of lesson 07)
keeps its code: whatever it stepped in one dtype (the whole weights, or this rank's shards) becomes the
bf16 tensor whose master AdamW steps. The collectives run on the bf16 tensors, so every byte sent is
e = 2 bytes an element. What each stage then holds is `accounting.held` at e = 2, e_m = 4.

`MasterStepped` is the same recipe written out for one process on plain autograd (no hooks, no ring): the
independent reference the mixed runs are compared with.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from distlab.proof.training import Plain, Tensors


def stepping_a_master(
    low: list[torch.Tensor], dtype: torch.dtype, make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer]
) -> tuple[torch.optim.Optimizer, list[nn.Parameter]]:
    """An optimizer that steps a `dtype` copy of each tensor of `low` (its master) in their place: the step's
    pre-hook hands each master its tensor's gradient (in `dtype`), the post-hook rounds the stepped master
    into its tensor and frees the master's gradient. Returns (optimizer, masters)."""
    masters = [nn.Parameter(t.detach().to(dtype)) for t in low]
    optimizer = make_optimizer(masters)

    def take_gradients(*_):
        for master, t in zip(masters, low):
            master.grad = None if t.grad is None else t.grad.to(dtype)  # None: not stepped (frozen, unused)

    def round_into_low(*_):
        with torch.no_grad():
            for master, t in zip(masters, low):
                t.copy_(master)  # rounded to bf16: what the next forward (or gather) reads
                master.grad = None  # the float32 gradient lives only for the step

    optimizer.register_step_pre_hook(take_gradients)
    optimizer.register_step_post_hook(round_into_low)
    return optimizer, masters


class MasterStepped(Plain):
    """One process under the mixed recipe, written out: `model` in bf16, plain autograd, `make_optimizer` on
    float32 masters; the record's parameters and optimizer states are the masters' (by the model's names),
    its gradients the bf16 ones backward made."""

    def __init__(self, model: nn.Module, dtype: torch.dtype, make_optimizer: Callable):
        self.masters = {name: nn.Parameter(p.detach().to(dtype)) for name, p in model.named_parameters()}
        super().__init__(model, make_optimizer(list(self.masters.values())))

    def zero_grad(self) -> None:
        self.model.zero_grad(set_to_none=True)  # the optimizer's parameters are the masters, not the model's

    def after_backward(self) -> None:
        for master, p in zip(self.masters.values(), self.model.parameters()):
            master.grad = None if p.grad is None else p.grad.to(master.dtype)

    def after_step(self) -> None:
        with torch.no_grad():
            for master, p in zip(self.masters.values(), self.model.parameters()):
                p.copy_(master)
                master.grad = None

    def params(self) -> Tensors:
        return {name: m.detach().clone() for name, m in self.masters.items()}

    def states(self) -> dict[str, Tensors]:
        return states_by_name(self.optimizer, self.masters)


def states_by_name(optimizer: torch.optim.Optimizer, stepped: dict[str, torch.Tensor]) -> dict[str, Tensors]:
    """The optimizer's state of each tensor it steps, by the name given (copies): a master under its weight's."""
    return {name: {k: v.detach().clone() for k, v in optimizer.state[t].items()} for name, t in stepped.items()}
