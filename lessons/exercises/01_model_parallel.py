"""Exercise 01: one step of naive model parallelism, the send/recv chain (read lessons/01_model_parallel.py
first; check your answer with `pytest --exercises -k 01`; add `--hint-level 1`, 2 or 3 for help).

The model is cut into P stages, stage p on rank p. Write `model_parallel_step`: rank p

    forward:   gets A_{p-1} from rank p - 1 (rank 0 starts from the batch x), computes A_p = f_p(A_{p-1})
               with `stage`, and passes A_p to rank p + 1; the last rank computes the loss
               L = mse(A_{P-1}, target), the mean over all its elements, as the unsplit model does;
    backward:  gets dL/dA_p from rank p + 1 (the last rank starts from L), back-propagates through its
               stage, and passes dL/dA_{p-1} to rank p - 1:

    dL/dtheta_p = dL/dA_p * dA_p/dtheta_p     and     dL/dA_{p-1} = dL/dA_p * dA_p/dA_{p-1}.

A tensor that arrives from another rank is plain numbers, without the graph that made it. Return L (a
float) on the last rank, None elsewhere. `shapes[p]` is the shape of A_{p-1}; `span(kind)` is a context
that records who computes when: wrap the forward's compute in span("F") and the backward's in span("I"),
and only the compute, never a wait.

The judge trains your stages for 2 steps and compares every stage's gradients and parameters, and the
loss, with the unsplit model in one process (float64), and checks from the spans that one rank computes
at a time.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist  # noqa: F401  (you will need it)
import torch.nn.functional as F  # noqa: F401  (you will need it)


def model_parallel_step(
    stage: torch.nn.Module, x: torch.Tensor, target: torch.Tensor, shapes: list, span=lambda kind: nullcontext()
) -> float | None:
    """Stage p = this rank: receive A_{p-1} (rank 0 starts from the batch x), compute A_p, send it on;
    then receive dL/dA_p (the last rank: from the loss), back-propagate, send dL/dA_{p-1} back.
    `shapes[p]` is the shape of A_{p-1}; `span(kind)` times the compute. Returns L on the last rank."""
    raise NotImplementedError("not written yet: model_parallel_step(stage, x, target, shapes, span)")
