"""Exercise 08: tensor parallelism's operator f (read lessons/08_tensor_parallel.py first; check your
answer with `pytest --exercises -k 08`).

A column-parallel layer needs the whole input X on every rank: rank r computes its d_out / P outputs
Y_r = X A_r^T + b_r. So X goes in unchanged; but each rank's backward only sees its own outputs, and
the gradient at X is the sum of what every rank sends back:

    forward:   f(X) = X                          (identity: every rank already holds X)
    backward:  dL/dX = sum_r dL_r/dX             (an all-reduce over the ranks of `group`)

Write `Copy`, an autograd Function, the f that the lesson puts before fc1 (the MLP) and before q, k, v
(attention). Its conjugate, g (all-reduce forward, identity backward), is the lesson's `Reduce`.

Hints:
- forward may return `x.view_as(x)` (a new tensor for autograd, the same values); keep `group` and
  `ledger` on `ctx` for backward;
- in backward, all-reduce a copy of the incoming gradient (`dist.all_reduce(t, group=group)`, in place)
  and record what was sent: `ledger.record("backward", "all_reduce", t, group)` (a
  `distlab.comm.ledger.Ledger`: it counts what a ring sends for that all-reduce);
- backward returns one gradient per forward input: the tensor's, then None for `group` and `ledger`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist  # noqa: F401  (you will need it)


class Copy(torch.autograd.Function):
    """f: identity forward, all-reduce backward."""

    @staticmethod
    def forward(ctx, x, group, ledger):
        raise NotImplementedError("not written yet: Copy.forward(ctx, x, group, ledger), the identity")

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError("not written yet: Copy.backward(ctx, grad), an all-reduce of grad")
