"""open_clip's `SigLipLoss` recipe, re-implemented with the same arithmetic: the baseline the streamed
sigmoid loss is measured and checked against.

Rank r holds its C image and text embeddings. Its loss is its own C x C block with labels (+1 on the
diagonal, -1 elsewhere) plus, for every other rank's text block, the C x C block with all labels -1
("negative only"), each block -sum log sigma(eps S) / C, S = s z_x z_y^T + beta. DDP averages the P ranks:
1/P sum_r (1/C) sum = (1/N) sum over all N^2 pairs = L. The other ranks' text blocks arrive by

  "bidir"   point-to-point exchanges with both neighbours at once: a block travels left and one right,
            (P - 1) // 2 rounds, plus one shift to the right when P - 1 is odd;
  "gather"  one all-gather with autograd, cut into the P blocks;

and autograd runs through the exchange: the gradient of a visiting block goes back to its owner (the
backward of a shift is the opposite shift, the backward of the all-gather a reduce-scatter), where
DDP's average of the ranks' parameter gradients is dL/dtheta. Autograd keeps every block's logits
for the backward: P blocks of C x C per rank, C N in all.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from distlab.comm import compat
from distlab.comm.p2p import post


def _exchange(sends: list[tuple[torch.Tensor, int]], srcs: list[int]) -> list[torch.Tensor]:
    """Send each (tensor, peer) and receive one tensor like it from each source, all at once (the
    ground floor's `post`), and wait."""
    sends = [(t.contiguous(), peer) for t, peer in sends]
    return post(sends, [(torch.empty_like(t), src) for (t, _), src in zip(sends, srcs)]).wait()


class Shift(torch.autograd.Function):
    """Send `tensor` to `dst`, receive from `src`; the backward sends the gradient back (dst -> src)."""

    @staticmethod
    def forward(ctx, src: int, dst: int, tensor: torch.Tensor) -> torch.Tensor:
        ctx.peers = (src, dst)
        return _exchange([(tensor, dst)], [src])[0]

    @staticmethod
    def backward(ctx, grad):
        src, dst = ctx.peers
        return None, None, Shift.apply(dst, src, grad)


class ShiftBoth(torch.autograd.Function):
    """Send one tensor left and one right; receive (from the right, from the left). Backward: the
    reverse exchange of the two gradients."""

    @staticmethod
    def forward(ctx, left: int, right: int, to_left: torch.Tensor, to_right: torch.Tensor):
        ctx.peers = (left, right)
        return tuple(_exchange([(to_left, left), (to_right, right)], [right, left]))

    @staticmethod
    def backward(ctx, grad_from_right, grad_from_left):
        left, right = ctx.peers
        # what came from the right goes back right, what came from the left goes back left
        back_right, back_left = _exchange([(grad_from_right, right), (grad_from_left, left)], [right, left])
        return None, None, back_left, back_right


def block_loss(
    z_x: torch.Tensor, z_y: torch.Tensor, s: torch.Tensor, b: torch.Tensor, negative_only: bool
) -> torch.Tensor:
    """-sum log sigma(eps S) / C over one C x C block (labels -1, and +1 on the diagonal unless
    negative only): the whole block of logits is made, and autograd keeps it."""
    logits = s * z_x @ z_y.T + b
    labels = -torch.ones_like(logits)
    if not negative_only:
        labels = labels + 2 * torch.eye(len(logits), dtype=logits.dtype, device=logits.device)
    return -F.logsigmoid(labels * logits).sum() / len(z_x)


def siglip_recipe_loss(
    z_x: torch.Tensor, z_y: torch.Tensor, s: torch.Tensor, b: torch.Tensor, variant: str
) -> torch.Tensor:
    """This rank's loss in open_clip's recipe ("bidir" or "gather"); backward it under DDP."""
    world, rank = dist.get_world_size(), dist.get_rank()
    loss = block_loss(z_x, z_y, s, b, negative_only=False)
    if world == 1:
        return loss
    if variant == "gather":
        blocks = compat.all_gather_autograd(z_y).chunk(world)
        return loss + sum(block_loss(z_x, blk, s, b, True) for i, blk in enumerate(blocks) if i != rank)
    left, right = (rank - 1) % world, (rank + 1) % world
    to_left = to_right = z_y
    rounds, odd = divmod(world - 1, 2)
    for _ in range(rounds):
        from_right, from_left = ShiftBoth.apply(left, right, to_left, to_right)
        loss = loss + block_loss(z_x, from_right, s, b, True) + block_loss(z_x, from_left, s, b, True)
        to_left, to_right = from_right, from_left
    if odd:
        loss = loss + block_loss(z_x, Shift.apply(left, right, to_right), s, b, True)
    return loss
