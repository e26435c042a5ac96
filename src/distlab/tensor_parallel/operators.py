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

Bytes, ring accounting as in lesson 06 for a full tensor of b bytes: all-reduce 2(P-1)/P b,
all-gather and reduce-scatter (P-1)/P b each; so f-bar + g-bar send exactly what f + g send.
`Traffic` adds them up by (direction, collective), as exact fractions.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from fractions import Fraction

import torch
import torch.distributed as dist

RING_FRACTION = {  # bytes sent per rank, in units of the full tensor's bytes, at P ranks
    "all_reduce": lambda p: Fraction(2 * (p - 1), p),
    "all_gather": lambda p: Fraction(p - 1, p),
    "reduce_scatter": lambda p: Fraction(p - 1, p),
}


@dataclass
class Traffic:
    """Bytes this rank sent, by (direction, collective): direction is "forward" or "backward"."""

    sent: dict = field(default_factory=lambda: defaultdict(Fraction))
    calls: dict = field(default_factory=lambda: defaultdict(int))

    def record(self, direction: str, kind: str, full: torch.Tensor, group) -> None:
        p = dist.get_world_size(group)
        self.sent[direction, kind] += RING_FRACTION[kind](p) * full.numel() * full.element_size()
        self.calls[direction, kind] += 1

    def total(self, direction: str | None = None) -> Fraction:
        return sum((b for (d, _), b in self.sent.items() if direction in (None, d)), Fraction(0))


def all_reduce(x: torch.Tensor, group, traffic: Traffic, direction: str) -> torch.Tensor:
    out = x.contiguous().clone()  # never reduce in place into a tensor autograd saved
    dist.all_reduce(out, group=group)
    traffic.record(direction, "all_reduce", out, group)
    return out


def all_gather_seq(x: torch.Tensor, group, traffic: Traffic, direction: str) -> torch.Tensor:
    """(N, seq/P, ...) on each rank -> (N, seq, ...), the ranks' parts in rank order."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    out = torch.cat(parts, dim=1)
    traffic.record(direction, "all_gather", out, group)
    return out


def reduce_scatter_seq(x: torch.Tensor, group, traffic: Traffic, direction: str) -> torch.Tensor:
    """(N, seq, ...) partial sums on each rank -> rank r's part (N, seq/P, ...) of their sum."""
    p = dist.get_world_size(group)
    parts = [c.contiguous() for c in x.chunk(p, dim=1)]
    out = torch.empty_like(parts[0])
    dist.reduce_scatter(out, parts, group=group)
    traffic.record(direction, "reduce_scatter", x, group)
    return out


def identity(x: torch.Tensor, group, traffic: Traffic, direction: str) -> torch.Tensor:
    return x.view_as(x)


def conjugate(name: str, forward_op, backward_op, doc: str) -> type:
    """An autograd Function running `forward_op` forward and `backward_op` backward. The four operators
    below are two such pairs and their transposes: swap the two ops and you have the conjugate."""

    class Conjugate(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group, traffic):
            ctx.group, ctx.traffic = group, traffic
            return forward_op(x, group, traffic, "forward")

        @staticmethod
        def backward(ctx, grad):
            return backward_op(grad, ctx.group, ctx.traffic, "backward"), None, None

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
    traffic: Traffic
    sequence_parallel: bool = False

    def to_parallel(self, x: torch.Tensor) -> torch.Tensor:
        return self.enter.apply(x, self.group, self.traffic)

    def from_parallel(self, x: torch.Tensor) -> torch.Tensor:
        return self.exit.apply(x, self.group, self.traffic)


def tensor_parallel(group=None, traffic: Traffic | None = None) -> Comm:
    return Comm(CopyToTP, ReduceFromTP, group, traffic or Traffic())


def sequence_parallel(group=None, traffic: Traffic | None = None) -> Comm:
    return Comm(GatherFromSP, ScatterToSP, group, traffic or Traffic(), sequence_parallel=True)
