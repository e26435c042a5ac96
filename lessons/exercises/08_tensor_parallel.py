"""Exercise 08: tensor parallelism's operator f (read lessons/08_tensor_parallel.py first; check your
answer with `pytest --exercises -k 08`; add `--hint-level 1`, 2 or 3 for help).

A column-parallel layer needs the whole input X on every rank: rank r computes its d_out / P outputs
Y_r = X A_r^T + b_r. So X goes in unchanged; but each rank's backward only sees its own outputs, and the
gradient at X is the sum of what every rank sends back:

    forward:   f(X) = X                          (every rank already holds X)
    backward:  dL/dX = sum_r dL_r/dX             (over the ranks of `group`)

Write `Copy`, an autograd Function, the f that the lesson puts before fc1 (the MLP) and before q, k, v
(attention). Its conjugate, g, is the lesson's `Reduce`. `forward(ctx, x, group, ledger)` takes the
process group to communicate over and a `distlab.comm.ledger.Ledger`, where the lesson counts bytes: every
collective you run is recorded there, `ledger.record(phase, kind, tensor, group)` with phase "forward" or
"backward" and kind "all_reduce". backward returns one gradient per forward input.

The judge checks f's forward and backward against one process holding every rank's tensors, the MLP split
with your f against the unsplit MLP (float64), the bytes the judge sees you send against those you
record, and those against the lesson's formula, 2 (P-1)/P N seq d e per backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist  # noqa: F401  (you will need it)


class Copy(torch.autograd.Function):
    """f: the identity forward, the sum over ranks backward."""

    @staticmethod
    def forward(ctx, x, group, ledger):
        raise NotImplementedError("not written yet: Copy.forward(ctx, x, group, ledger), the identity")

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError("not written yet: Copy.backward(ctx, grad)")
