"""Exercise 06: data parallelism by hand (read lessons/06_data_parallel.py first; check your answer with
`pytest --exercises -k 06`; add `--hint-level 1`, 2 or 3 for help, none is printed at 0).

Every rank holds the same model and a different C = N / P rows of the batch, and has just run backward on
the mean loss over its own rows, so param.grad holds dL_r/dtheta. Write `all_reduce_gradients`: when it
returns, every rank's param.grad must hold the gradient of the mean loss over all N rows,

    dL/dtheta = (1/N) sum_i dl_i/dtheta = (1/P) sum_r dL_r/dtheta     (equal shares: C rows each),

so that the same optimizer step on every rank keeps the replicas identical to one process on the whole
batch. The judge checks the gradients and, after two SGD steps, the parameters against one process (float64,
rtol 1e-10), and prices the collectives you call by the ring formulas: a step may send no more than the
lesson's collective does, 2 (P-1)/P Psi e bytes per rank for Psi parameters of e bytes.

The judge's model has the shapes real models have: a parameter held by the model itself, not by a layer
(`logit_scale`), an embedding weight tied to the output layer's (one tensor, one gradient), and frozen
parameters (requires_grad False: no gradient, nothing to reduce). Every rank uses every parameter.

What you have: torch.distributed is initialised; `rt.world_size` is P, `rt.rank` this rank, and
`rt.device` the device every tensor (and so every collective) is on.
"""

from __future__ import annotations

import torch.distributed as dist  # noqa: F401  (you will need it)
from torch import nn

from distlab.processes.identity import Runtime


def all_reduce_gradients(model: nn.Module, rt: Runtime) -> None:
    """After backward on this rank's rows: every param.grad becomes the mean over ranks."""
    raise NotImplementedError("not written yet: all_reduce_gradients(model, rt)")
