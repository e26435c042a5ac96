"""Exercise 12: the all-gather whose backward sums over ranks (read lessons/12_contrastive_allgather_fix.py
first; check your answer with `pytest --exercises -k 12`).

Write `gather_all_reduce(z)`: rank r holds its C x d block z_r of embeddings; return the N x d
concatenation Z = [z_0; z_1; ...; z_{P-1}] (N = P C, rank r's rows at r C .. r C + C - 1), differentiable so
that the gradient reaching z_r is the sum over every rank s of the gradient that rank s's loss L_s sends to
Z's rows of r:

    forward:   Z = all_gather(z_r)
    backward:  dL/dz_r = sum_s (dL_s/dZ)[r C : (r + 1) C]

A plain all_gather's backward keeps only rank r's own term (dL_r/dZ)[rows of r]: the loss is exact, the
gradient is not (lesson 11).

Hints:
- write a `torch.autograd.Function` with a `forward(ctx, z)` and a `backward(ctx, grad)`;
- `dist.all_gather_single(out, z.contiguous())` fills a preallocated N x d `out`;
- in backward, sum `grad` over ranks with `dist.all_reduce` (on a copy: autograd's buffer is not yours),
  then return this rank's C rows (remember the rank and C in `ctx`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist  # noqa: F401  (you will need it)


def gather_all_reduce(z: torch.Tensor) -> torch.Tensor:
    """This rank's C x d `z` -> the N x d gathered Z, whose backward sums the gradient over ranks."""
    raise NotImplementedError(
        "not written yet: gather_all_reduce(z), an all_gather forward and an "
        "all_reduce(SUM) backward that returns this rank's C rows"
    )
