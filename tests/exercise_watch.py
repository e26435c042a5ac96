"""What the exercises' judge sees beyond numbers: every allocation's shape, how many tensors of a kind are
alive at once, and every collective, on one rank.

`Watch` is a `TorchDispatchMode`, like `distlab.proof.memory.PeakMemory`: every op of the answer (its backward
too: autograd runs a CPU graph on the calling thread, under the same mode) passes through it. For each new
storage it records the shape (so "nothing N x N, C x N or B x N" is a question about `shapes`), and, when
`kind(shape)` names the tensor ("k/v block", "C x d block"), counts it alive until its storage is freed
(a `weakref.finalize`): `peak[kind]` is the most of that kind this rank held at once, the per-rank memory
a lesson bounds.

Collectives reach the dispatcher as ops in one of three namespaces: `c10d` (what `torch.distributed`'s
functions call, `torch.distributed.nn.functional`'s autograd gathers included), `_c10d_functional` (the
functional collectives of `torch.distributed._functional_collectives`, DTensor's) and
`_c10d_functional_autograd` (their autograd forms). `collectives` lists each call as a `Call`: its kind,
the bytes of its whole tensor (the all-gather's output, the reduce-scatter's input, the all-reduce's
tensor) and the size of the group it ran on; `sent` prices them by the ring formulas over that group, so a
check counts all-reduces and bytes without trusting what the answer says it sent. A call whose bytes
depend on the rank (an all-to-all, a gather, a scatter, a send) is recorded with the bytes this rank sends
exactly: its input but the part for itself. A barrier costs nothing and is still listed.

An op the table below does not know is never a crash: it is listed in `unknown` (and, for the judge,
`unknown_ops()` collects every one this process saw, so `exercise_kit` turns it into a failed claim that
names it), priced at nothing.

DDP's own all-reduce runs inside its reducer, where no mode sees it: the checks count it with a DDP comm
hook (`distlab.data_split.data_parallel.ddp.counting`).
"""

from __future__ import annotations

import weakref
from collections import Counter
from collections.abc import Callable
from fractions import Fraction
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from distlab.comm.collectives import ring_fraction

COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd")
NOT_COLLECTIVES = {"check_for_nan", "wait_tensor", "_wrap_tensor_autograd"}  # in those namespaces, moving nothing

# op name -> (the collective it is, how its whole tensor is found). The "how":
#   first / second   the tensor(s) of that argument (c10d: the all-gather's outputs are its first argument,
#                    the reduce-scatter's input its second)
#   gathered         the input times the group's size (a functional all-gather takes only its input)
#   sent             the bytes this rank sends, worked out from the rank (all-to-all, gather, scatter, send)
#   none             nothing moves (a barrier, a receive: its sender counts it)
C10D = {
    "allreduce_": ("all_reduce", "first"),
    "allreduce_coalesced_": ("all_reduce", "first"),
    "allgather_": ("all_gather", "first"),
    "_allgather_base_": ("all_gather", "first"),
    "allgather_coalesced_": ("all_gather", "first"),
    "allgather_into_tensor_coalesced_": ("all_gather", "first"),
    "reduce_scatter_": ("reduce_scatter", "second"),
    "_reduce_scatter_base_": ("reduce_scatter", "second"),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", "second"),
    "reduce_": ("reduce", "first"),
    "broadcast_": ("broadcast", "first"),
    "alltoall_base_": ("all_to_all", "sent"),
    "alltoall_": ("all_to_all", "sent"),
    "gather_": ("gather", "sent"),
    "scatter_": ("scatter", "sent"),
    "send": ("send", "first"),
    "recv_": ("recv", "none"),
    "recv_any_source_": ("recv", "none"),
    "barrier": ("barrier", "none"),
    "monitored_barrier_": ("barrier", "none"),
}
FUNCTIONAL = {  # _c10d_functional and _c10d_functional_autograd: (input, ..., group name last)
    "all_reduce": ("all_reduce", "first"),
    "all_reduce_": ("all_reduce", "first"),
    "all_reduce_coalesced": ("all_reduce", "first"),
    "all_reduce_coalesced_": ("all_reduce", "first"),
    "all_gather_into_tensor": ("all_gather", "gathered"),
    "all_gather_into_tensor_out": ("all_gather", "gathered"),
    "all_gather_into_tensor_coalesced": ("all_gather", "gathered"),
    "reduce_scatter_tensor": ("reduce_scatter", "first"),
    "reduce_scatter_tensor_out": ("reduce_scatter", "first"),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", "first"),
    "all_to_all_single": ("all_to_all", "sent"),
    "broadcast": ("broadcast", "first"),
    "broadcast_": ("broadcast", "first"),
    "isend": ("send", "first"),
    "irecv": ("recv", "none"),
    "batch_p2p_ops": ("send", "sent"),
}
# what rank r of a group of P sends, in units of the whole tensor ("sent" kinds are recorded as sent: 1)
PRICES: dict[str, Callable[[int], Fraction]] = {
    **{kind: (lambda p, kind=kind: ring_fraction(kind, p)) for kind in ("all_reduce", "all_gather", "reduce_scatter")},
    "broadcast": lambda p: Fraction(p - 1, p),  # pipelined through a ring: (P-1)/P of it per rank
    "reduce": lambda p: Fraction(p - 1, p),  # the broadcast run backwards
    **{kind: (lambda p: Fraction(1)) for kind in ("send", "all_to_all", "gather", "scatter")},
    **{kind: (lambda p: Fraction(0)) for kind in ("recv", "barrier")},
}
_UNKNOWN: list[str] = []  # every op this process saw that the tables above do not know (`unknown_ops`)


class Call(NamedTuple):
    """One collective this rank ran: its kind, the bytes of its whole tensor (or, for the kinds priced at
    1, the bytes it sends) and the size of its group (None: the world passed to `Watch.sent`)."""

    kind: str
    nbytes: int
    size: int | None = None


class Watch(TorchDispatchMode):
    """with Watch(kind, keep) as w: ...;  w.shapes, w.peak[kind], w.kept, w.calls(), w.sent(P), w.unknown"""

    def __init__(
        self, kind: Callable[[tuple], str | None] = lambda shape: None, keep: Callable[[tuple], bool] | None = None
    ) -> None:
        super().__init__()
        self.kind = kind
        self.keep = keep  # shapes whose values a check reads afterwards (which logits the answer computed)
        self.kept: list[torch.Tensor] = []  # a copy of every new tensor of those shapes, in order
        self.shapes: set[tuple] = set()
        self.live: Counter = Counter()
        self.peak: Counter = Counter()
        self.collectives: list[Call] = []
        self.unknown: list[str] = []  # "namespace.op" of every op this watch could not price
        self._seen: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        if func.namespace in COLLECTIVE_NAMESPACES and name not in NOT_COLLECTIVES:
            self._collective(func.namespace, name, args, kwargs or {})
            return out
        inputs = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in inputs:
                self._track(t)
                if self.keep is not None and t.is_floating_point() and self.keep(tuple(t.shape)):
                    self.kept.append(t.detach().clone())
        return out

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        if storage._cdata in self._seen or storage.nbytes() == 0:
            return
        self._seen.add(storage._cdata)
        self.shapes.add(tuple(t.shape))
        kind = self.kind(tuple(t.shape))
        if kind is not None:
            self.live[kind] += 1
            self.peak[kind] = max(self.peak[kind], self.live[kind])
        weakref.finalize(storage, self._release, storage._cdata, kind)

    def _release(self, key: int, kind: str | None) -> None:
        self._seen.discard(key)
        if kind is not None:
            self.live[kind] -= 1

    def _collective(self, namespace: str, op: str, args: tuple, kwargs: dict) -> None:
        table = C10D if namespace == "c10d" else FUNCTIONAL
        if op not in table:
            self.unknown.append(f"{namespace}.{op}")
            _UNKNOWN.append(f"{namespace}.{op}")
            self.collectives.append(Call(f"unknown {namespace}.{op}", 0))
            return
        kind, how = table[op]
        group = _group_of(namespace, args)
        size = group.size() if group is not None else None
        if how == "sent":
            nbytes = _sent(namespace, op, args, group)
        elif how == "none":
            nbytes = 0
        else:
            whole = args[1] if how == "second" else args[0]
            nbytes = sum(t.numel() * t.element_size() for t in tree_leaves(whole) if isinstance(t, torch.Tensor))
            nbytes *= size if how == "gathered" else 1
        self.collectives.append(Call(kind, nbytes, size))

    def calls(self) -> Counter:
        """How many times each collective ran, by kind ("all_reduce", "all_gather", "send", "barrier", ...)."""
        return Counter(call[0] for call in self.collectives)

    def sent(self, world: int) -> float:
        """Bytes this rank sends in the collectives it ran: all-reduce 2 (P-1)/P of the tensor, all-gather
        and reduce-scatter (P-1)/P of the whole, broadcast and reduce (P-1)/P of it (`distlab.comm`'s
        `ring_fraction`; P the size of the group each ran on, `world` when unknown), plus the bytes each
        all-to-all, gather, scatter and send hands over; receives and barriers send nothing, and an op
        the judge does not know is priced at nothing (it fails its own claim, `unknown_ops`)."""
        total = Fraction(0)
        for call in self.collectives:
            kind, nbytes, size = (*call, None)[:3]
            if kind in PRICES:
                total += PRICES[kind](size or world) * nbytes
        return float(total)


# c10d ops that name one rank: (the word before it, the argument holding its rank within the group)
ROOTED = {
    "reduce_": ("to", 3),
    "gather_": ("to", 3),
    "send": ("to", 2),
    "broadcast_": ("from", 2),
    "scatter_": ("from", 3),
    "recv_": ("from", 2),
}


class Ran(TorchDispatchMode):
    """What an answer ran on this rank, in order: each collective as one phrase, "reduce to rank 0 on ranks
    0-2", "send to rank 1 on ranks 0-1" (global ranks: to whom, on which group), so a verdict can say what the
    answer did and not only what its numbers missed. Only collectives are looked at; every other op passes
    straight through. With `log`, each phrase is also appended to that file as the call starts, so a rank
    that never returns (its peers gone, a collective no one joined) leaves its record behind."""

    def __init__(self, log: str | None = None) -> None:
        super().__init__()
        self.log = log
        self.calls: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if func.namespace in COLLECTIVE_NAMESPACES and name not in NOT_COLLECTIVES:
            self.calls.append(phrase(func.namespace, name, args))
            if self.log:
                with open(self.log, "a") as f:
                    f.write(self.calls[-1] + "\n")
        return func(*args, **(kwargs or {}))


class Messages(TorchDispatchMode):
    """What this rank's point-to-point messages carried, in order: ("send", peer, tensor) and ("recv", peer,
    tensor), a copy of each tensor, peers in global ranks. A check compares them with the reference's tensors at
    the same cut, so a wrong number is placed: the message where it first went wrong, and whether this rank
    changed what it received before passing it on. A receive's buffer fills only once its work is waited on,
    outside the dispatcher: it is copied at the next op the rank runs (before that op, which may change it in
    place) or when the mode exits."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[tuple[str, int, torch.Tensor]] = []
        self._arriving: list[tuple[int, torch.Tensor]] = []

    def _arrived(self) -> None:
        arriving, self._arriving = self._arriving, []  # emptied first: the copies below pass through this mode
        self.messages += [("recv", peer, t.detach().clone()) for peer, t in arriving]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._arrived()
        name = func.__name__.split(".")[0]
        if func.namespace == "c10d" and name in ("send", "recv_"):
            group = _group_of("c10d", args)
            ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
            tensors = [t for t in tree_leaves(args[0]) if isinstance(t, torch.Tensor)]
            if name == "send":
                self.messages += [("send", ranks[args[2]], t.detach().clone()) for t in tensors]
            else:
                self._arriving += [(ranks[args[2]], t) for t in tensors]
        return func(*args, **(kwargs or {}))

    def __exit__(self, *exc):
        self._arrived()
        return super().__exit__(*exc)

    def of(self, kind: str, peer: int) -> list[torch.Tensor]:
        """The tensors of `kind` ("send", "recv") exchanged with global rank `peer`, in order."""
        self._arrived()
        return [t for k, q, t in self.messages if k == kind and q == peer]


def phrase(namespace: str, op: str, args: tuple) -> str:
    """One collective in words: its kind, its root or peer and its group, in global ranks."""
    table = C10D if namespace == "c10d" else FUNCTIONAL
    kind = table.get(op, (f"{namespace}.{op}",))[0]
    group = _group_of(namespace, args)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    words = [kind]
    if namespace == "c10d" and op in ROOTED:
        word, at = ROOTED[op]
        words.append(f"{word} rank {ranks[args[at]] if 0 <= args[at] < len(ranks) else args[at]}")
    span = f"{ranks[0]}-{ranks[-1]}" if ranks == list(range(ranks[0], ranks[-1] + 1)) else ",".join(map(str, ranks))
    return " ".join(words) + f" on ranks {span}"


def ran_text(calls: list[str], most: int = 5) -> str:
    """A rank's collectives, each phrase once with its count, in the order first run: "reduce to rank 0 on
    ranks 0-2 x7"; "nothing" when it ran none."""
    counts = Counter(calls)
    parts = [f"{c} x{n}" if n > 1 else c for c, n in counts.items()]
    more = f", and {len(parts) - most} more kinds" if len(parts) > most else ""
    return ", ".join(parts[:most]) + more if parts else "no collective"


def unknown_ops(since: int = 0) -> list[str]:
    """Every collective op this process saw that `Watch` cannot price, after the first `since`."""
    return _UNKNOWN[since:]


def _group_of(namespace: str, args: tuple):
    """The process group an op ran on: a c10d op carries it boxed (its first ProcessGroup argument), a
    functional one by name (its last argument; batch_p2p_ops's too)."""
    if namespace == "c10d":
        for a in args:
            if isinstance(a, torch.ScriptObject):
                try:
                    return dist.ProcessGroup.unbox(a)
                except (RuntimeError, TypeError):
                    continue
        return None
    try:
        return _resolve_process_group(args[-1])
    except (ValueError, RuntimeError, TypeError):
        return None


def _sent(namespace: str, op: str, args: tuple, group) -> int:
    """The bytes this rank sends in a call whose share depends on its rank."""
    me = group.rank() if group is not None else 0
    if op == "alltoall_base_":  # (output, input, group, output splits, input splits, ...)
        return _part_sent(args[1], args[4], group)
    if op == "all_to_all_single":  # (input, output splits, input splits, group name)
        return _part_sent(args[0], args[2], group)
    if op == "alltoall_":  # (outputs, inputs, group, ...): every input but the one for this rank
        return sum(_bytes(t) for q, t in enumerate(args[1]) if q != me)
    if op == "gather_":  # (outputs, inputs, group, root, ...): a non-root sends its input, the root keeps its own
        return 0 if me == args[3] else sum(_bytes(t) for t in args[1])
    if op == "scatter_":  # (outputs, inputs, group, root, ...): the root sends every part but its own
        return sum(_bytes(t) for q, t in enumerate(tree_leaves(args[1])) if q != me) if me == args[3] else 0
    if op == "batch_p2p_ops":  # (op names, peers, tags, tensors, group name)
        return sum(_bytes(t) for name, t in zip(args[0], args[3]) if "send" in name)
    raise AssertionError(f"{namespace}.{op} is priced as sent but has no rule")


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _part_sent(x: torch.Tensor, splits: list[int] | None, group) -> int:
    """Bytes an all-to-all of x's rows over `group` sends: every row but those of this rank's own part
    (no splits: P equal parts)."""
    row = x[0].numel() * x.element_size() if len(x) else 0
    own = splits[group.rank()] if splits else len(x) // group.size()
    return (len(x) - own) * row


def spanning(shapes: set[tuple], long: int, across: set[int]) -> list[tuple]:
    """The shapes with `long` in one dimension and one of `across` in another: the forbidden temporaries
    (N x N, C x N, B x N for long = N, across = {N, C, B})."""
    found = []
    for shape in shapes:
        for i, size in enumerate(shape):
            if size == long and any(other in across for j, other in enumerate(shape) if j != i):
                found.append(shape)
                break
    return sorted(found)
