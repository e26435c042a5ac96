"""How a value of an answer's differs from the lesson's, in words that point at a slip (`exercise_trace` finds
where they part): two traces of the same call compared, the lesson's run and the answer's. The first operation
that is not the lesson's (another op, shape or dtype, other values, what a collective is handed), the first
value a name takes that is not the lesson's value of that name, and the first thing a call leaves behind that
differs, each read as what a slip leaves: a factor, zeros or NaN, another shape, the lesson's values transposed
or reordered, the value held before, only this statement's term where the lesson's adds it to the value before
(or the reverse), another of the lesson's values, the rows or the diagonal that differ."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from exercise_trace import _Ops, _Trace

COLLECTIVES = (
    "allreduce",
    "allgather",
    "reduce_scatter",
    "broadcast",
    "alltoall",
    "send",
    "recv",
    "reduce_",
    "gather",
    "scatter",
)
OTHERS = 2000  # the lesson's other values a departing one is compared with, at most


def op_departure(mine: _Ops, theirs: _Ops, values: bool = True) -> str | None:
    """The first operation of the answer's that is not the lesson's (another op, another shape or dtype, other
    values; with `values` False, the first other op, shape or dtype: another computation, where other values
    may only carry an earlier difference), with the answer's line that ran it."""
    for k, (line, name, told, source, arrived) in enumerate(mine.ops):
        at = f"line {line} ({source[:80]})"
        if k >= len(theirs.ops):
            return f"{at} runs {name}, past the end of the lesson's {len(theirs.ops)} operations"
        their_name, their_told = theirs.ops[k][1:3]
        if name != their_name:
            return f"{at} runs {name}{_shapes(told)} where the lesson's runs {their_name}{_shapes(their_told)}"
        if [t[:2] for t in told] != [t[:2] for t in their_told]:
            return f"{at}: its {name} gives{_shapes(told)}, the lesson's{_shapes(their_told)}"
        if values and not _told_same(told, their_told):
            if name.startswith(COLLECTIVES):  # a collective's summary is of what it was handed
                earlier = [(o[0], o[3]) for o in theirs.ops[:k] if o[1] == name and _told_same(told, o[2])]
                was = f": what the lesson's handed its {name} at line {earlier[-1][0]}" if earlier else ""
                return f"{at}: its {name} is handed other values than the lesson's{was}"
            a, b = next(
                (a, b) for (_, _, a), (_, _, b) in zip(told, their_told) if not _told_same(((0, 0, a),), ((0, 0, b),))
            )
            got = f"{at}{', on what arrived from another rank' if arrived else ''}"
            return f"{got}: its {name} gives other values than the lesson's (sum {a[0]:.6g}, the lesson's {b[0]:.6g})"
    return None


def _told_same(told: tuple, their_told: tuple) -> bool:
    """Two `_summary`s alike: the same dtypes and shapes, the sums equal to rounding (unsummed ones pass)."""
    if [t[:2] for t in told] != [t[:2] for t in their_told]:
        return False
    return all(
        a is None or b is None or all(_close(x, y, b[1]) for x, y in zip(a, b))
        for (_, _, a), (_, _, b) in zip(told, their_told)
    )


def _close(x: float, y: float, scale: float) -> bool:
    return (math.isnan(x) and math.isnan(y)) or math.isclose(x, y, rel_tol=1e-6, abs_tol=1e-9 * max(abs(scale), 1e-30))


def _shapes(told: tuple) -> str:
    return " -> " + ", ".join(f"{dtype} {list(shape)}" for dtype, shape, _ in told) if told else ""


def same(a: Any, b: Any) -> bool:
    """Two kept values alike: tensors of one shape equal to rounding (1e-6 of the larger's scale), the same
    atoms, lists and objects alike item by item."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.shape != b.shape or a.dtype.is_floating_point != b.dtype.is_floating_point:
            return False
        if a.dtype in (torch.bool,) or not a.dtype.is_floating_point:
            return bool(torch.equal(a.to(b.dtype), b))
        a, b = a.double(), b.double()
        scale = b[torch.isfinite(b)].abs().max().item() if torch.isfinite(b).any() else 1.0
        return bool(torch.allclose(a, b, rtol=1e-6, atol=1e-9 * max(scale, 1e-30), equal_nan=True))
    if isinstance(a, tuple) and isinstance(b, tuple) and a[0] == b[0] == "list":
        return len(a[1]) == len(b[1]) and all(same(x, y) for x, y in zip(a[1], b[1]))
    if isinstance(a, tuple) and isinstance(b, tuple) and a[0] == b[0] == "object":
        return (
            a[1] == b[1]
            and [k for k, _ in a[2]] == [k for k, _ in b[2]]
            and all(same(x, y) for (_, x), (_, y) in zip(a[2], b[2]))
        )
    if isinstance(a, tuple) and isinstance(b, tuple) and a[0] == b[0] == "atom":
        x, y = a[1], b[1]
        if isinstance(x, str) or isinstance(y, str):
            return x == y
        if isinstance(x, float) or isinstance(y, float):
            return x is not None and y is not None and math.isclose(x, y, rel_tol=1e-6, abs_tol=1e-12)
        return x == y
    return False


def _said(value: Any) -> str:
    """A kept value in a few words: a tensor's dtype and shape (and its values, when it holds at most four)."""
    if isinstance(value, torch.Tensor):
        shape = list(value.shape)
        if value.numel() <= 4 and value.dtype.is_floating_point:
            values = [round(v, 4) for v in value.double().reshape(-1).tolist()]
            return f"{str(value.dtype).removeprefix('torch.')} {shape} = {values}"
        return f"{str(value.dtype).removeprefix('torch.')} {shape}"
    if value[0] == "atom":
        v = value[1]
        return f"{v:.6g}" if isinstance(v, float) else repr(v)
    if value[0] == "object":
        return f"a {value[1]}"
    inner = ", ".join(_said(v) for v in value[1][:3])
    return f"[{inner}{', ...' if len(value[1]) > 3 else ''}] ({len(value[1])} items)"


def _factor(k: float) -> str:
    """A ratio as the small fraction it is (3, -1, 1/2, 5/6), else to four figures."""
    for q in (1, 2, 3, 4, 6, 8):
        for sign in (1, -1):
            for num in range(1, 65):
                if abs(k - sign * num / q) <= 1e-6 * max(1.0, abs(k)):
                    return f"{sign * num}" if q == 1 else f"{sign * num}/{q}"
    return f"{k:.4g}"


def _how(mine: Any, theirs: Any, before: Any, elsewhere: list[tuple[str, Any]]) -> str:
    """How `mine` differs from the lesson's `theirs`, in the words that point at a slip."""
    if isinstance(mine, torch.Tensor) and isinstance(theirs, torch.Tensor):
        if mine.shape != theirs.shape:
            told = f"yours is {_said(mine)}, the lesson's {_said(theirs)}"
            if mine.dim() == 2 and mine.shape == theirs.t().shape and same(mine, theirs.t().contiguous()):
                told += ": the lesson's transposed"
            elif mine.numel() == theirs.numel() and same(_sorted(mine), _sorted(theirs)):
                told += ": the same values in another shape"
            return told
        if mine.dtype.is_floating_point and theirs.dtype.is_floating_point:
            m, t = mine.double(), theirs.double()
            if torch.isnan(m).any() and not torch.isnan(t).any():
                return f"yours holds NaN ({int(torch.isnan(m).sum())} of {m.numel()} elements), the lesson's none"
            if m.abs().max() == 0 and t.abs().max() > 0:
                return f"yours is all zeros, the lesson's not ({_said(theirs)})"
            for label, other in [("the value it held before this statement", before)] + elsewhere:
                if other is not None and same(mine, other):
                    return f"yours equals {label}"
            if m.dim() == 2 and m.shape[0] == m.shape[1] and same(mine, theirs.t().contiguous()):
                return "yours is the lesson's transposed"
            tt = (t * t).sum()
            if tt > 0:
                k = ((m * t).sum() / tt).item()
                if (m - k * t).abs().max() <= 1e-6 * max(t.abs().max().item(), 1e-30):
                    return f"yours is {_factor(k)} times the lesson's ({_said(mine)})"
            if same(_sorted(mine), _sorted(theirs)):
                return "yours holds the lesson's values in another order"
            return _where(m, t)
        return f"yours is {_said(mine)}, the lesson's {_said(theirs)}"
    if isinstance(mine, tuple) and isinstance(theirs, tuple) and mine[0] == theirs[0] == "atom":
        for label, other in [("the value it held before this statement", before)] + elsewhere:
            if other is not None and same(mine, other):
                return f"yours is {_said(mine)}, the lesson's {_said(theirs)}: yours equals {label}"
        x, y = mine[1], theirs[1]
        said = f"yours is {_said(mine)}, the lesson's {_said(theirs)}"
        numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (x, y))
        if numbers and y != 0:
            said += f" ({_factor(x / y)} times)" if x / y != 1 else ""
        return said
    if isinstance(mine, tuple) and isinstance(theirs, tuple) and mine[0] == theirs[0] == "object":
        if mine[1] != theirs[1] or [k for k, _ in mine[2]] != [k for k, _ in theirs[2]]:
            return f"yours is a {mine[1]}, the lesson's a {theirs[1]}"
        k, a, b = next((k, a, b) for (k, a), (_, b) in zip(mine[2], theirs[2]) if not same(a, b))
        return f"its field .{k}: " + _how(a, b, None, [])
    if isinstance(mine, tuple) and isinstance(theirs, tuple) and mine[0] == theirs[0] == "list":
        if len(mine[1]) != len(theirs[1]):
            return f"yours holds {len(mine[1])} items, the lesson's {len(theirs[1])}"
        differ = [k for k, (a, b) in enumerate(zip(mine[1], theirs[1])) if not same(a, b)]
        first = differ[0]
        return f"items {_list(differ)} of {len(mine[1])} differ; item {first}: " + _how(
            mine[1][first], theirs[1][first], None, []
        )
    return f"yours is {_said(mine)}, the lesson's {_said(theirs)}"


def _sorted(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).double().sort().values


def _list(ks: list[int]) -> str:
    return ", ".join(map(str, ks[:8])) + (", ..." if len(ks) > 8 else "")


def _where(m: torch.Tensor, t: torch.Tensor) -> str:
    """Which part of a same-shaped tensor differs: the rows (dim 0 indices) or the elements, and by how much."""
    off = ~torch.isclose(m, t, rtol=1e-6, atol=1e-9 * max(t.abs().max().item(), 1e-30))
    worst = (m - t).abs().max().item() / max(t.abs().max().item(), 1e-30)
    if m.dim() == 2 and m.shape[0] == m.shape[1] and torch.equal(off, torch.eye(len(m), dtype=torch.bool)):
        mine, theirs = m.diagonal().unique().tolist(), t.diagonal().unique().tolist()
        return f"only the diagonal differs: yours holds {_few(mine)} there, the lesson's {_few(theirs)}"
    if m.dim() >= 2:
        rows = off.reshape(m.shape[0], -1).any(dim=1).nonzero().flatten().tolist()
        if len(rows) < m.shape[0]:
            return f"rows {_list(rows)} of {m.shape[0]} differ (by up to {worst:.0%} of its largest), the rest agree"
    return f"{int(off.sum())} of {m.numel()} elements differ, by up to {worst:.0%} of the lesson's largest"


def _few(values: list) -> str:
    return ", ".join(f"{v:.4g}" for v in values[:4]) + (", ..." if len(values) > 4 else "")


def _added(mine: Any, mine_before: Any, theirs: Any, theirs_before: Any) -> str:
    """A value assigned where the lesson's adds to what it held, or added where the lesson's assigns."""
    if all(isinstance(v, tuple) and v[0] == "atom" for v in (mine, mine_before, theirs, theirs_before)):
        numbers = [v[1] for v in (mine, mine_before, theirs, theirs_before)]
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in numbers):
            mine, mine_before, theirs, theirs_before = (torch.tensor(float(v)) for v in numbers)
    if not all(isinstance(v, torch.Tensor) and v.dtype.is_floating_point for v in (mine, mine_before, theirs)):
        return ""
    if not isinstance(theirs_before, torch.Tensor) or not (mine.shape == theirs.shape == theirs_before.shape):
        return ""
    if same(mine, theirs - theirs_before):
        return "yours holds only what this statement adds this time; the lesson's adds it to the value before"
    if mine.shape == mine_before.shape and same(mine - mine_before, theirs):
        return "yours adds this statement's value to the one before; the lesson's replaces it"
    return ""


def departure(mine: _Trace, lesson: _Trace) -> str | None:
    """The first value of the answer's that is not the lesson's (same function, same name, same index), in the
    words `_how` finds; None when every value of a name the lesson has agrees."""
    for func, name, k in mine.order:
        theirs = lesson.values.get((func, name))
        if theirs is None:  # a name of the learner's own: nothing to compare it with
            continue
        line, value = mine.values[(func, name)][k]
        source = mine.lines.get(line, "")
        at = f"`{name}` in {func}, set at line {line} ({source[:80]})"
        if k >= len(theirs):
            return f"{at}: yours sets it {len(mine.values[(func, name)])} times or more, the lesson's {len(theirs)}"
        if same(value, theirs[k][1]):
            continue
        before = mine.values[(func, name)][k - 1][1] if k else None
        if k and _added(value, before, theirs[k][1], theirs[k - 1][1]):
            return f"{at}: {_added(value, before, theirs[k][1], theirs[k - 1][1])}"
        elsewhere = [(f"the lesson's value {j + 1} of `{name}`", v) for j, (_, v) in enumerate(theirs) if j != k]
        elsewhere += [
            (f"the lesson's `{n}`" + (f" (its value {j + 1})" if len(vs) > 1 else ""), v)
            for (f, n), vs in lesson.values.items()
            if f == func and n != name
            for j, (_, v) in enumerate(vs)
        ][:OTHERS]
        return f"{at}: {_how(value, theirs[k][1], before, elsewhere)}"
    return None


def effect(mine: dict[str, Any], theirs: dict[str, Any]) -> str | None:
    """The first thing a call left behind that is not the lesson's (what it returned, then the arguments)."""
    for label, value in mine.items():
        if label in theirs and not same(value, theirs[label]):
            return f"after the call, {label}: {_how(value, theirs[label], None, [])}"
    return None
