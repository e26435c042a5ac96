"""Gathering embeddings from every rank, and what each gather does to the gradient.

Forward, every gather here returns the N x d concatenation of the ranks' C x d blocks, in rank
order. They differ in backward. On rank s the gathered tensor Z = [z_0; ...; z_{P-1}] receives
dL_s/dZ, the gradient of rank s's *own* loss, for every block; rank r's block needs the sum over
all ranks, sum_s dL_s/dZ[rC : (r+1)C].

- `gather_plain`: an all-gather (`dist.all_gather_single`) has no autograd, so only the local block is
  put back with its graph and backward keeps rank r's slice of dL_r/dZ alone: what every other rank's loss says about
  rank r's embeddings is dropped. Right when every rank computes the same global loss (lesson 21,
  up to DDP's 1/P), wrong for local x global (lesson 22).
- `gather_with_grad`: backward sums over ranks and hands rank r its slice, in one reduce-scatter
  (`GatherSumBackward`): (P-1)/P * N d numbers sent per rank on a ring. Lesson 23 writes out the
  same idea with an all_reduce backward (2 (P-1)/P * N d: every rank receives every block's sum and
  keeps one) and checks both; lessons 24 and 25 import this one.
- `gather_library`: torch's own differentiable all-gather. torch 2.13 deprecates
  `torch.distributed.nn.functional.all_gather` and its warning names the replacement,
  `torch.distributed._functional_collectives.all_gather_single`, whose op has a registered autograd
  formula (`all_gather_into_tensor_backward`, a reduce-scatter with sum): the one for real code. (torch
  2.11 names it `all_gather_tensor_autograd`; `distlab.comm.compat` picks the name the installed torch has.)

On gloo (CPU) a reduce-scatter (`reduce_scatter_single`) runs as an all-reduce of a copy followed by taking this rank's
chunk (`ProcessGroupGloo::reduce_scatter_tensor_coalesced`), so on CPU the two backwards cost the
same; the halving is NCCL's.

The gathers read the rank from the process group they run on (`dist.get_rank()`): a collective's
slice is the rank's place in *that* group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from distlab.comm import compat


def all_gather_blocks(tensor: torch.Tensor) -> torch.Tensor:
    """The ranks' C x ... blocks stacked in rank order (P C x ...), no autograd."""
    out = tensor.new_empty((dist.get_world_size() * tensor.shape[0], *tensor.shape[1:]))
    compat.all_gather_single(out, tensor.contiguous())
    return out


def gather_plain(tensor: torch.Tensor) -> torch.Tensor:
    """The plain all-gather (no autograd), with this rank's block put back so that it keeps its graph."""
    blocks = list(all_gather_blocks(tensor.detach()).chunk(dist.get_world_size()))
    blocks[dist.get_rank()] = tensor
    return torch.cat(blocks)


class GatherSumBackward(torch.autograd.Function):
    """Forward: all-gather. Backward: one reduce-scatter with sum, so rank r receives
    sum_s dL_s/dZ[rC : (r+1)C], and only that."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor) -> torch.Tensor:
        ctx.rows = tensor.shape[0]
        return all_gather_blocks(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        mine = grad.new_empty((ctx.rows, *grad.shape[1:]))
        compat.reduce_scatter_single(mine, grad.contiguous(), op=dist.ReduceOp.SUM)
        return mine


def gather_with_grad(tensor: torch.Tensor) -> torch.Tensor:
    """All-gather whose backward sums the gradient over ranks (a reduce-scatter)."""
    return GatherSumBackward.apply(tensor)


def gather_library(tensor: torch.Tensor) -> torch.Tensor:
    """torch's differentiable all-gather (functional collectives), the one to use in real code."""
    return compat.all_gather_autograd(tensor)
