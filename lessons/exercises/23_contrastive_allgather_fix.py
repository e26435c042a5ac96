"""Exercise 23: the all-gather whose backward sums over ranks (read lessons/23_contrastive_allgather_fix.py
first; check your answer with `pytest --exercises -k 23`; add `--hint-level 1`, 2 or 3 for help).

Write `gather_all_reduce(z)`: rank r holds its C x d block z_r of embeddings; return the N x d
concatenation Z = [z_0; z_1; ...; z_{P-1}] (N = P C, rank r's rows at r C .. r C + C - 1), differentiable so
that the gradient reaching z_r is the sum over every rank s of the gradient that rank s's loss L_s sends to
Z's rows of r:

    forward:   Z = [z_0; z_1; ...; z_{P-1}]
    backward:  dL/dz_r = sum_s (dL_s/dZ)[r C : (r + 1) C]

A plain all-gather's backward keeps only rank r's own term (dL_r/dZ)[rows of r]: the loss is exact, the
gradient is not (lesson 22). The judge checks the gathered Z, the gradient at each rank's embeddings against
P times the full batch's (each L_s is a mean over C rows, so sum_s L_s = P L), and prices the collectives
it sees: the exchange may cost no more than the lesson's, a gather forward and one reduction backward of
N x d.

What you have: torch.distributed is initialised; autograd lets you write a forward and its backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist  # noqa: F401  (you will need it)


def gather_all_reduce(z: torch.Tensor) -> torch.Tensor:
    """This rank's C x d `z` -> the N x d gathered Z, whose backward sums the gradient over ranks."""
    raise NotImplementedError("not written yet: gather_all_reduce(z)")
