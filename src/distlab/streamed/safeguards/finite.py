"""A non-finite loss or gradient never reaches the parameters: the step's checks on values, after phase 2 and
after phase 5.

After phase 2 the global loss L is one float, the same on every rank (its shares are summed in one order
everywhere), so every rank sees the same non-finite L with no exchange: `distributed_train_step` raises
`loss_not_finite` before any backward, naming the ranks whose embeddings were not finite
(`embeddings_not_finite`, read from the gathered Z_x, Z_y) or the scale whose logits overflowed.

After phase 5 a finite L can still leave a non-finite gradient (an overflow in a tower's backward, a NaN from a
sqrt at 0), and under FSDP2 only one rank may hold it: `agree_gradients_finite` checks every rank's own
gradients in one fused pass (`finite_flags`) and agrees across ranks before the optimizer steps.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from distlab.comm.agree import raise_together
from distlab.streamed.config import StreamConfig
from distlab.streamed.safeguards.step_call import exchange_group
from distlab.streamed.wrappers import first_device


def embeddings_not_finite(z_x: torch.Tensor, z_y: torch.Tensor, s: float, cfg: StreamConfig) -> str:
    """Which ranks' embeddings are not finite, read from the gathered N x d Z_x, Z_y (C rows a rank, in the rank
    order of the step's group): the same words on every rank, with no exchange."""
    finite = torch.isfinite(z_x).all(dim=1) & torch.isfinite(z_y).all(dim=1)
    ranks = dist.get_process_group_ranks(cfg.group or dist.group.WORLD)
    bad = sorted({ranks[i // cfg.local] for i in (~finite).nonzero().flatten().tolist()})
    if not bad:
        return f"every embedding is finite; the logits s z_x . z_y overflowed (s = {s:g})"
    return f"non-finite embeddings on rank{'s' if len(bad) > 1 else ''} {', '.join(map(str, bad))}"


def loss_not_finite(loss: float, why: str) -> FloatingPointError:
    """The error when the global loss is not finite (raised on every rank alike, before any backward; the caller
    has put BatchNorm's running statistics back)."""
    return FloatingPointError(
        f"the global loss is {loss} ({why}): "
        "no gradient was computed, the optimizer did not step, BatchNorm's statistics "
        "are as they were"
    )


def agree_gradients_finite(model: torch.nn.Module) -> None:
    """Every rank checks its own gradients (under FSDP2 its shards: one rank may hold the only NaN) and the
    ranks agree, over the wrapper's group, before anyone steps: one FloatingPointError on every rank naming
    the ranks and the parameters, or none. One small all-gather per step; one host sync for the check.

    The check is one fused pass (`finite_flags`): GradScaler's own non-finite check,
    `torch._amp_foreach_non_finite_check_and_unscale_` with an inverse scale of 1 (every value written back bit for
    bit), reads each gradient once, tests each element with isfinite (no arithmetic: nothing overflows, so a finite
    gradient is never taken for a non-finite one) and sets one flag per device and dtype; only a set flag sends the
    check back to name the tensors. On a CPU it takes a tenth of the infinity norm `torch._foreach_norm(grads, inf)`
    it replaced, which CPU builds do not vectorise (`benchmarks/loss_module_costs.py`)."""
    group = exchange_group(model)
    named = [(name, p.grad) for name, p in model.named_parameters() if p.grad is not None]
    local = [g.to_local() if hasattr(g, "to_local") else g for _, g in named]  # a DTensor's own shard
    bad = [name for (name, _), ok in zip(named, finite_flags(local)) if not ok]
    problem = None
    if bad:
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        problem = (
            f"a non-finite gradient (the loss was finite: the backward overflowed or made a NaN) in "
            f"{', '.join(bad[:3])}{more}: the optimizer did not step, parameters and optimizer state are as they were"
        )
    device = local[0].device if local else first_device(model, None)
    raise_together(problem, device, FloatingPointError, group=group)


def finite_flags(grads: list[torch.Tensor]) -> list[bool]:
    """Whether each tensor holds only finite values, exactly `[bool(torch.isfinite(g).all()) for g in grads]`.
    One fused pass per (device, dtype) group (GradScaler's check with inverse scale 1, which writes each value
    back unchanged), one host sync for all; a group whose flag is set is looked at tensor by tensor (the rare
    path: only then is a boolean tensor made per gradient). An empty tensor is finite."""
    groups: dict[tuple, list[int]] = {}
    for i, g in enumerate(grads):
        if g.numel():
            groups.setdefault((g.device, g.dtype), []).append(i)
    flags = [True] * len(grads)
    if not groups:
        return flags
    found = []
    for (device, _), at in groups.items():
        found_inf, one = torch.zeros(1, device=device), torch.ones(1, device=device)
        torch._amp_foreach_non_finite_check_and_unscale_([grads[i] for i in at], found_inf, one)
        found.append(found_inf)
    any_bad = torch.cat([f.to(found[0].device) for f in found]).tolist()  # the one host sync
    for at, bad in zip(groups.values(), any_bad):
        if bad:
            for i in at:
                flags[i] = bool(torch.isfinite(grads[i]).all())
    return flags
