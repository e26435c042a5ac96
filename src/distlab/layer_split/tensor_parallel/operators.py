"""The conjugate communication operators of tensor and sequence parallelism, as autograd Functions,
each counting the bytes it makes this rank send.

Tensor parallelism (Megatron-LM's f and g). A column-parallel layer needs the whole input X on every
rank; a row-parallel layer leaves a partial sum on every rank. So

    copy_to_tp      (f):  forward  identity          backward  all-reduce (sum of dL/dX over ranks)
    reduce_from_tp  (g):  forward  all-reduce         backward  identity

Each is the other's transpose: the gradient of "the same X goes to every rank" is "add what came
back", and the gradient of a sum is the same gradient for every addend.

Sequence parallelism splits the all-reduce into its two halves, a reduce-scatter and an all-gather
(lesson 06), and keeps the tensor between blocks cut along the sequence (dim 1):

    gather_from_sp   (f-bar):  forward  all-gather along seq     backward  reduce-scatter along seq
    scatter_to_sp    (g-bar):  forward  reduce-scatter along seq  backward  all-gather along seq

(Korthikanti et al. name this pair g and g-bar; our bar means "the sequence-parallel f or g", so their g
is our f-bar, and their g-bar our g-bar.)

Bytes, ring accounting as in lesson 06 for a full tensor of `bytes`: all-reduce 2(P-1)/P bytes,
all-gather and reduce-scatter (P-1)/P bytes each (`distlab.comm.collectives`); so f-bar + g-bar send
exactly what f + g send. A `distlab.comm.ledger.Ledger` counts them by (direction, collective), in
exact integers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from distlab.comm.ledger import Ledger


def all_reduce(x: torch.Tensor, group, ledger: Ledger, direction: str) -> torch.Tensor:
    out = x.contiguous().clone()  # never reduce in place into a tensor autograd saved
    dist.all_reduce(out, group=group)
    ledger.record(direction, "all_reduce", out, group)
    return out


def all_gather_seq(x: torch.Tensor, group, ledger: Ledger, direction: str) -> torch.Tensor:
    """(N, seq/P, ...) on each rank -> (N, seq, ...), the ranks' parts in rank order."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    out = torch.cat(parts, dim=1)
    ledger.record(direction, "all_gather", out, group)
    return out


def reduce_scatter_seq(x: torch.Tensor, group, ledger: Ledger, direction: str) -> torch.Tensor:
    """(N, seq, ...) partial sums on each rank -> rank r's part (N, seq/P, ...) of their sum."""
    world = dist.get_world_size(group)
    parts = [c.contiguous() for c in x.chunk(world, dim=1)]
    out = torch.empty_like(parts[0])
    dist.reduce_scatter(out, parts, group=group)
    ledger.record(direction, "reduce_scatter", x, group)
    return out


def identity(x: torch.Tensor, group, ledger: Ledger, direction: str) -> torch.Tensor:
    return x.view_as(x)


def conjugate(name: str, forward_op, backward_op, doc: str) -> type:
    """An autograd Function running `forward_op` forward and `backward_op` backward. The four operators
    below are two such pairs and their transposes: swap the two ops and you have the conjugate."""

    class Conjugate(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group, ledger):
            ctx.group, ctx.ledger = group, ledger
            return forward_op(x, group, ledger, "forward")

        @staticmethod
        def backward(ctx, grad):
            return backward_op(grad, ctx.group, ctx.ledger, "backward"), None, None

    Conjugate.__name__ = Conjugate.__qualname__ = name
    Conjugate.__doc__ = doc
    return Conjugate


CopyToTP = conjugate("CopyToTP", identity, all_reduce, "f: identity forward, all-reduce backward.")
ReduceFromTP = conjugate("ReduceFromTP", all_reduce, identity, "g: all-reduce forward, identity backward.")
GatherFromSP = conjugate(
    "GatherFromSP",
    all_gather_seq,
    reduce_scatter_seq,
    "f-bar: all-gather along the sequence forward, reduce-scatter backward.",
)
ScatterToSP = conjugate(
    "ScatterToSP",
    reduce_scatter_seq,
    all_gather_seq,
    "g-bar: reduce-scatter along the sequence forward, all-gather backward.",
)


@dataclass(frozen=True)
class Comm:
    """The pair a block is built with: `enter` before its column-parallel layers, `exit` after its
    row-parallel one. Tensor parallel: (f, g); sequence parallel: (f-bar, g-bar)."""

    enter: object
    exit: object
    group: object
    ledger: Ledger  # what the operators sent, by (direction, collective)
    sequence_parallel: bool = False

    def to_parallel(self, x: torch.Tensor) -> torch.Tensor:
        return self.enter.apply(x, self.group, self.ledger)

    def from_parallel(self, x: torch.Tensor) -> torch.Tensor:
        return self.exit.apply(x, self.group, self.ledger)


def tensor_parallel(group=None, ledger: Ledger | None = None) -> Comm:
    return Comm(CopyToTP, ReduceFromTP, group, ledger if ledger is not None else Ledger())


def sequence_parallel(group=None, ledger: Ledger | None = None) -> Comm:
    return Comm(GatherFromSP, ScatterToSP, group, ledger if ledger is not None else Ledger(), sequence_parallel=True)
