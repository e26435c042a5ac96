"""One DDP contrastive step: forward, a variant's loss, backward (DDP averages), and its gradients.

The optimizer step and zero_grad are the caller's (`distlab.contrastive.training` owns the loop).
`first_step_gradients` is what lessons 21-23 and their tests compare with the single-process
reference: `TwoTower(seed)` in DDP, `paired_data(N, seed)` split into the ranks' blocks, one step
per variant.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from distlab.contrastive.batch import check_inputs, local_block
from distlab.contrastive.variants import Losses, Variant
from distlab.processes.identity import Runtime
from distlab.proof.compare import grads_of
from distlab.proof.models import TwoTower, paired_data


def contrastive_loss(rt: Runtime, z_x: torch.Tensor, z_y: torch.Tensor, tau: float, variant: Variant) -> Losses:
    """`variant`'s (loss to back-propagate, L), after checking every rank's input on every rank:
    bad input is the same ValueError everywhere, never a rank left waiting in a gather."""
    check_inputs(z_x, z_y, tau)
    return variant(rt, z_x, z_y, tau)


def wrap_ddp(model: nn.Module, rt: Runtime) -> DistributedDataParallel:
    """`model`, moved to the rank's device and wrapped in DDP (one GPU per rank on CUDA)."""
    model = model.to(rt.device)
    return DistributedDataParallel(model, device_ids=[rt.device] if rt.device.type == "cuda" else None)


def ddp_step(rt: Runtime, ddp: nn.Module, x: torch.Tensor, y: torch.Tensor, tau: float, variant: Variant) -> float:
    """Forward this rank's pairs, back-propagate the variant's loss; returns the global loss L."""
    z_x, z_y = ddp(x, y)
    loss, value = contrastive_loss(rt, z_x, z_y, tau, variant)
    loss.backward()
    return value.item()


def first_step_gradients(
    rt: Runtime, variants: Sequence[Variant], n: int, tau: float, seed: int = 0, dtype: torch.dtype = torch.float64
) -> dict[str, tuple[float, dict[str, torch.Tensor]]]:
    """Variant name -> (L, DDP gradients on the CPU) after one step on the first global batch.

    The single-process reference for it is
    `full_batch_gradients(TwoTower(seed), *paired_data(n, seed), 1 / tau)`.
    """
    x, y = (local_block(t, rt).to(rt.device) for t in paired_data(n, seed=seed, dtype=dtype))
    ddp = wrap_ddp(TwoTower(seed=seed, dtype=dtype), rt)
    out = {}
    for variant in variants:
        ddp.zero_grad(set_to_none=True)
        loss = ddp_step(rt, ddp, x, y, tau, variant)
        out[variant.name] = (loss, {name: g.cpu() for name, g in grads_of(ddp.module).items()})
    return out
