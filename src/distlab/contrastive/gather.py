"""Gathering embeddings from every rank, and what each gather does to the gradient.

Forward, all three return the N x d concatenation of the ranks' C x d blocks, in rank order. They
differ in backward, where rank r receives dL_r/d(gathered), the gradient of *its own* loss only:

- `gather_plain` (seed 003, CODE BLOCK 2): `dist.all_gather` has no autograd; only the local block is
  put back into the result with its graph, so backward keeps the local slice of dL_r/d(gathered) and
  drops what every other rank's loss says about this rank's embeddings. Correct when every rank
  computes the same global loss (lesson 07), wrong for local x global (lesson 08).
- `gather_with_grad(..., backward="all_reduce")` (seed 003's fix): backward sums the gradient over ranks,
  sum_r dL_r/d(gathered), and keeps this rank's slice. `backward="reduce_scatter"` gets the same slice
  with a reduce-scatter, which moves (P-1)/P * N*d numbers per rank instead of the all-reduce's
  2 (P-1)/P * N*d: half the traffic, and no rank keeps slices it throws away.
- `gather_library`: torch's own differentiable all-gather. torch 2.13 deprecates
  `torch.distributed.nn.functional.all_gather` and its warning names the replacement,
  `torch.distributed._functional_collectives.all_gather_single`: its op has an autograd formula
  registered (`all_gather_into_tensor_backward`, a reduce-scatter with sum), so the plain functional
  gather is the fix (`all_gather_single_autograd` is now only an alias of it).

Traffic, for a ring: the backward all-reduce moves 2 (P-1)/P * N*d numbers per rank, the
reduce-scatter (P-1)/P * N*d. That is NCCL's picture. gloo (the CPU backend) implements
`reduce_scatter_tensor` as an all-reduce of a copy followed by taking this rank's chunk
(`ProcessGroupGloo::reduce_scatter_tensor_coalesced`), so on CPU both cost the same.

Seed 003's bugs, fixed here: CODE BLOCK 1 and 2 gather `feature1` into `all_feature2`; its AllGather
backward slices with `rank` (a global it never defines) instead of `ctx.rank`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol


def check_same_shape(tensor: torch.Tensor) -> None:
    """Raise the same ValueError on every rank unless all ranks hold tensors of one shape.

    A gather of unequal blocks would hang or scramble; this exchanges only the shapes (a small,
    always-matching all-gather) so every rank can refuse together.
    """
    max_dims = 8
    if tensor.dim() > max_dims:
        raise ValueError(f"tensors of more than {max_dims} dimensions are not supported")
    mine = torch.full((max_dims + 1,), -1, dtype=torch.int64, device=tensor.device)
    mine[0] = tensor.dim()
    mine[1:tensor.dim() + 1] = torch.tensor(tensor.shape, dtype=torch.int64)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    shapes = [tuple(t[1:t[0] + 1].tolist()) for t in every]
    if len(set(shapes)) > 1:
        raise ValueError(f"every rank must hold a block of the same shape to gather, got {shapes} "
                         "(rank 0, 1, ...): give each rank an equal share of the global batch")


def _gather_blocks(tensor: torch.Tensor) -> torch.Tensor:
    out = torch.empty((dist.get_world_size() * tensor.shape[0], *tensor.shape[1:]),
                      dtype=tensor.dtype, device=tensor.device)
    dist.all_gather_single(out, tensor.contiguous())
    return out


def gather_plain(tensor: torch.Tensor) -> torch.Tensor:
    """`dist.all_gather`, with the local block put back so it keeps its graph (CODE BLOCK 2)."""
    blocks = list(_gather_blocks(tensor.detach()).chunk(dist.get_world_size()))
    blocks[dist.get_rank()] = tensor
    return torch.cat(blocks)


class _GatherSumBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, backward: str) -> torch.Tensor:
        ctx.rank, ctx.rows, ctx.backward = dist.get_rank(), tensor.shape[0], backward
        return _gather_blocks(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        if ctx.backward == "all_reduce":
            dist.all_reduce(grad, op=dist.ReduceOp.SUM)
            return grad[ctx.rank * ctx.rows:(ctx.rank + 1) * ctx.rows], None
        mine = torch.empty((ctx.rows, *grad.shape[1:]), dtype=grad.dtype, device=grad.device)
        dist.reduce_scatter_single(mine, grad, op=dist.ReduceOp.SUM)
        return mine, None


def gather_with_grad(tensor: torch.Tensor, backward: str = "reduce_scatter") -> torch.Tensor:
    """All-gather whose backward sums the gradient over ranks ("all_reduce" or "reduce_scatter")."""
    if backward not in ("all_reduce", "reduce_scatter"):
        raise ValueError(f"backward must be 'all_reduce' or 'reduce_scatter', got {backward!r}")
    return _GatherSumBackward.apply(tensor, backward)


def gather_library(tensor: torch.Tensor) -> torch.Tensor:
    """torch's differentiable all-gather (functional collectives), the one to use in real code."""
    return funcol.all_gather_single(tensor.contiguous(), 0, dist.group.WORLD)
