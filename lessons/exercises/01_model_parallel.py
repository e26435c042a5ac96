"""Exercise 01: one step of naive model parallelism, the send/recv chain (read lessons/01_model_parallel.py
first; check your answer with `pytest --exercises -k 01`).

The model is cut into P stages, stage p on rank p. Write `model_parallel_step`: rank p

    forward:   receives A_{p-1} from rank p - 1 (rank 0 starts from the batch x), computes
               A_p = f_p(A_{p-1}) with `stage`, and sends A_p to rank p + 1;
               the last rank computes the loss L = mse(A_{P-1}, target);
    backward:  receives dL/dA_p from rank p + 1 (the last rank starts from L), back-propagates through
               its stage, and sends dL/dA_{p-1} to rank p - 1:

    dL/dtheta_p = dL/dA_p * dA_p/dtheta_p     and     dL/dA_{p-1} = dL/dA_p * dA_p/dA_{p-1}.

A received tensor arrives as plain numbers, without its graph: mark it `requires_grad_()` so that its
`.grad` after the backward is dL/dA_{p-1}, the gradient to send back. Return L (a float) on the last rank,
None elsewhere. The judge trains your stages and compares their gradients with the unsplit model's.

Hints:
- `p, last = dist.get_rank(), dist.get_world_size() - 1`;
- receive into `torch.empty(shapes[p], dtype=x.dtype, device=x.device)` with `dist.recv(buf, src=p - 1)`;
- send `a_out.detach()` forward; resume the backward with `a_out.backward(grad_out)`;
- wrap the forward in `with span("F"):` and the backward in `with span("I"):` (it records who computes when).
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
    raise NotImplementedError(
        "not written yet: model_parallel_step(stage, x, target, shapes, span), the forward "
        "sent down the stages with dist.send/recv and the gradient dL/dA sent back up"
    )
