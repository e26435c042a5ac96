"""The collectives whose names changed between torch 2.11 and 2.13, looked up in one place.

distlab pins torch 2.13.0, but the GPU machines this project is lent run the image's torch 2.11, and the
project runs on both. Three names differ (torch 2.13's, then torch 2.11's):

    all-gather into one tensor (no autograd)   dist.all_gather_single      dist.all_gather_into_tensor
    reduce-scatter of one tensor               dist.reduce_scatter_single  dist.reduce_scatter_tensor
    differentiable functional all-gather       funcol.all_gather_single    funcol.all_gather_tensor_autograd
                                               (or .._single_autograd)

(`dist` is `torch.distributed`, `funcol` its `_functional_collectives`.) torch 2.13 keeps the old names as
deprecated aliases that warn; torch 2.11 has only the old ones, and in 2.11 the functional gather without
`_autograd` carries no gradient. Each function below takes the new name when the installed torch has it,
else the old one, with the same arguments and the same result.

The name is looked up at every call, not once at import: strict device mode (`distlab.processes.strict`) wraps
`torch.distributed`'s collectives while it is on, and tests replace them, and both must see every call.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol


def _first(module, *names: str):
    """The first of `names` that `module` has (the newest first)."""
    for name in names:
        found = getattr(module, name, None)
        if found is not None:
            return found
    raise AttributeError(f"{module.__name__} has none of {', '.join(names)} (torch {torch.__version__})")


def all_gather_single(output: torch.Tensor, tensor: torch.Tensor, group=None, async_op: bool = False):
    """Every rank's `tensor` into `output` (P x its rows), rank r's at rows r C .. r C + C - 1; no autograd."""
    gather = _first(dist, "all_gather_single", "all_gather_into_tensor")
    return gather(output, tensor, group=group, async_op=async_op)


def reduce_scatter_single(
    output: torch.Tensor, tensor: torch.Tensor, op=dist.ReduceOp.SUM, group=None, async_op: bool = False
):
    """The sum over ranks of `tensor` (P C x ...), rank r keeping rows r C .. r C + C - 1 in `output`."""
    scatter = _first(dist, "reduce_scatter_single", "reduce_scatter_tensor")
    return scatter(output, tensor, op=op, group=group, async_op=async_op)


def all_gather_autograd(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """torch's differentiable all-gather along dim 0 (backward: a reduce-scatter with sum), on `group`
    (default: every rank)."""
    gather = _first(funcol, "all_gather_single_autograd", "all_gather_tensor_autograd")
    return gather(tensor.contiguous(), 0, group if group is not None else dist.group.WORLD)
