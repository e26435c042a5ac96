"""torch's own collectives, counted by the group they ran on: the measured side of a mesh's byte formulas.

When torch runs the communication (DTensor's tensor parallelism, FSDP2's gathers and reduce-scatters,
the pipeline schedules' sends), no code of ours calls a collective we could count. Every one of them
still reaches the dispatcher as an op: `c10d.*` (what `torch.distributed`'s functions call, with the
process group as an argument) or `_c10d_functional.*` (DTensor's, with the group's name). A
`TorchDispatchMode` sees each op as it runs, backward included (autograd runs a CPU graph on the calling
thread, under the same mode), so it can note the group, the kind and the tensor, and price the call as
`distlab.comm.ledger.Ledger.record` prices ours: what a ring sends for it (`distlab.comm.collectives`),
and for a point-to-point send the bytes handed to the transport.

    with CollectiveWatch({"tp": tp_group, "dp": dp_group}) as watch:
        ...                                     # set watch.phase = "forward", "backward", ... as you go
    watch.ledgers["tp"].sent_by                 # {(phase, kind): bytes} of what ran on the tp group

A group is known by its ranks, not by the object: DTensor caches its sharding decisions by mesh, and a
mesh built again over the same ranks (the next mesh shape of a lesson) may run on the earlier mesh's group
of those ranks. A group of ranks outside `groups` is counted under the label "other". Two labels may name
one set of ranks (a mesh's dp x cp dimension flattened is its cp group when dp = 1): then `kinds` tells
them apart by what runs on each, {"cp": ("send",)}, and a call goes to the first label whose kinds include it. The full
tensor, as the ring formulas take it: the gathered one (all-gather), the reduced one (all-reduce,
reduce-scatter); received messages are not counted (their sender counts them).
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.utils._python_dispatch import TorchDispatchMode

from distlab.comm.collectives import ring_bytes
from distlab.comm.ledger import SEND, Ledger

KINDS = {  # op name (either namespace) -> (collective, which argument holds the full tensor)
    "allreduce_": ("all_reduce", "first"),
    "all_reduce": ("all_reduce", "first"),
    "all_reduce_coalesced": ("all_reduce", "first"),
    "_allgather_base_": ("all_gather", "first"),  # (output, input, ...): the output is the gathered one
    "allgather_into_tensor_coalesced_": ("all_gather", "first"),
    "all_gather_into_tensor": ("all_gather", "gathered"),  # (input, group_size, ...): input x group size
    "all_gather_into_tensor_coalesced": ("all_gather", "gathered"),
    "_reduce_scatter_base_": ("reduce_scatter", "second"),  # (output, input, ...): the input is reduced
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", "second"),
    "reduce_scatter_tensor": ("reduce_scatter", "first"),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", "first"),
    "send": (SEND, "first"),
}


def _tensors(arg) -> list[torch.Tensor]:
    return list(arg) if isinstance(arg, (list, tuple)) else [arg]


def _group_of(args: tuple) -> dist.ProcessGroup | None:
    """The process group an op ran on: a c10d op carries it boxed, a functional op by name (its last
    argument: an earlier string is the reduce op, 'sum')."""
    for a in reversed(args):
        if isinstance(a, str):
            return _resolve_process_group(a)
        if isinstance(a, dist.ProcessGroup):
            return a
        if type(a).__name__ == "ScriptObject":
            try:
                return dist.ProcessGroup.unbox(a)
            except RuntimeError:  # another boxed class (a ReduceOp): not the group
                continue
    return None


class CollectiveWatch(TorchDispatchMode):
    """Counts every collective and send this rank runs, by group label, into one `Ledger` per label."""

    def __init__(self, groups: dict[str, dist.ProcessGroup], kinds: dict[str, tuple[str, ...]] | None = None):
        super().__init__()
        self.labels: dict[tuple[int, ...], list[str]] = defaultdict(list)  # a group's ranks -> its labels
        for label, group in groups.items():
            self.labels[tuple(dist.get_process_group_ranks(group))].append(label)
        self.kinds = kinds or {}
        self.ledgers: dict[str, Ledger] = defaultdict(Ledger)
        self.phase = ""

    def label(self, group: dist.ProcessGroup | None, kind: str) -> str:
        """The label a call of `kind` on `group` is counted under."""
        names = self.labels.get(tuple(dist.get_process_group_ranks(group)), []) if group is not None else []
        return next((n for n in names if kind in self.kinds.get(n, (kind,))), "other")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        if func.namespace in ("c10d", "_c10d_functional") and name in KINDS:
            self._count(name, args)
        return out

    def _count(self, name: str, args: tuple) -> None:
        kind, where = KINDS[name]
        group = _group_of(args)
        ledger = self.ledgers[self.label(group, kind)]
        if kind == SEND:
            ledger.count_sends(_tensors(args[0]), self.phase)
            return
        size = group.size()
        tensors = _tensors(args[1] if where == "second" else args[0])
        for t in tensors:
            numel = t.numel() * (size if where == "gathered" else 1)
            ledger.add(self.phase, kind, ring_bytes(kind, numel, t.element_size(), size, group.rank()))
