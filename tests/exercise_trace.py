"""Where an answer first departs from the lesson's function (`exercise_ranks._rank`): each call of the answer is
shadowed by the lesson's own function, run first on deep copies of the same arguments (the random state restored
after it, every watch of the judge's blind to it), and both runs are traced: every tensor operation, with the
answer's line that ran it, and every value a local name of the answer's file takes, with the statement that set
it. Where the two first part is told in words by `exercise_readings`, with the learner's own statement.

A hint, never a verdict: the claims judge against an independent reference; the lesson's function only says
where to look. It reads only where the answer's names are the lesson's (a blank keeps the lesson's signature),
and it stays silent where it cannot copy the arguments (a torchft manager, a DTensor model), where the answer is
a class (an autograd Function), or where the lesson's run raises. A buffer allocated without filling
(`torch.empty`) is zeroed in both runs: what the memory held before is no difference."""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import linecache
import random
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from exercise_readings import departure, effect, op_departure
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

DEPARTS = "where yours first departs from the lesson's: "
CALLS = 4  # calls shadowed at most: the first departure is almost always in the first
LIMIT = 1 << 20  # elements kept of one tensor at most
JUDGE = str(Path(__file__).parent / "")  # the judge's files: its hooks' operations are not the answer's
BOOKKEEPING = ("lift_fresh", "lift_fresh_copy", "alias")  # a constant made a tensor, a view of all of one
CLOCKS = ("perf_counter", "time.time", "monotonic")  # statements whose values differ from run to run

_ATOMIC: list[type] = [torch.device, torch.dtype]  # shared, never copied: see `_copied`
if dist.is_available():
    from torch._C._distributed_c10d import ProcessGroup, Store, Work
    from torch.distributed.device_mesh import DeviceMesh

    _ATOMIC += [ProcessGroup, Store, Work, DeviceMesh]


def _copied(value: Any) -> Any:
    """A deep copy of the call's arguments, one memo for all (an optimizer keeps pointing at the copied model's
    parameters); the process groups, stores and meshes are shared, as the lesson's run must talk to the same
    peers. Raises where something cannot be copied (the shadow is then given up)."""
    dispatch = copy._deepcopy_dispatch  # type: ignore[attr-defined]
    saved = {t: dispatch.get(t) for t in _ATOMIC}
    dispatch.update({t: copy._deepcopy_atomic for t in _ATOMIC})  # type: ignore[attr-defined]
    try:
        copies = copy.deepcopy(value)
    finally:
        for t, was in saved.items():
            if was is None:
                dispatch.pop(t, None)
            else:
                dispatch[t] = was
    for module in _modules(copies):  # the judge's hooks watch the answer's run, not the lesson's
        for hooks in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks"):
            getattr(module, hooks, {}).clear()
        for param in module.parameters(recurse=False):
            param._backward_hooks = None
            param._post_accumulate_grad_hooks = None
    return copies


def _modules(value: Any, depth: int = 0):
    """Every module in the copied arguments (inside lists, tuples, dicts and plain objects, a few levels)."""
    if isinstance(value, torch.nn.Module):
        yield from value.modules()
    elif depth < 3 and isinstance(value, (list, tuple)):
        for v in value:
            yield from _modules(v, depth + 1)
    elif depth < 3 and isinstance(value, dict):
        for v in value.values():
            yield from _modules(v, depth + 1)
    elif depth < 3 and _plain(value):
        for v in vars(value).values():
            yield from _modules(v, depth + 1)


def _kept(value: Any, depth: int = 0) -> Any:
    """What is kept of a local's value: a tensor's detached copy, a number or a short string (an atom), a short
    list or tuple of those, a plain object's public fields (a layout's, a plan's: its tensors and atoms, not its
    floats, which may be a clock's); None for anything else (a module, a long list), which is not compared."""
    if isinstance(value, torch.Tensor):
        if is_traceable_wrapper_subclass(value) or value.layout != torch.strided or value.is_meta:
            return None  # a DTensor, a float8 wrapper: reading it could run a collective
        if value.numel() > LIMIT:
            return None
        try:
            return value.detach().to("cpu", copy=True)
        except Exception:  # a DTensor's local view, a fake tensor: not compared
            return None
    if isinstance(value, (bool, int, float)) or value is None:
        return ("atom", value)
    if isinstance(value, str) and len(value) <= 80:
        return ("atom", value)
    if depth == 0 and _plain(value):  # a dataclass or a plain object: its public fields, one level down
        fields = [(k, _kept(v, 1)) for k, v in list(vars(value).items())[:32] if not k.startswith("_")]
        fields = [(k, v) for k, v in fields if not (isinstance(v, tuple) and isinstance(v[1], float))]  # a clock's
        fields = tuple((k, v) for k, v in fields if v is not None)
        return ("object", type(value).__name__, fields) if fields else None
    if isinstance(value, (list, tuple)) and depth == 0 and 0 < len(value) <= 64:
        items = [_kept(v, 1) for v in value]
        return None if any(i is None for i in items) else ("list", tuple(items))
    return None


def _plain(value: Any) -> bool:
    """An object of the lessons' own kind (a layout, a plan, a shape), not a module, a tensor or torch's."""
    module = type(value).__module__ or ""
    return (
        isinstance(getattr(value, "__dict__", None), dict)
        and not isinstance(value, (torch.nn.Module, torch.Tensor, type))
        and not module.startswith(("torch", "builtins", "numpy"))
        and not callable(value)
    )


def _print(value: Any) -> Any:
    """A cheap fingerprint: changes when the local is bound to another object or a tensor is changed in place."""
    if isinstance(value, torch.Tensor):
        return (id(value), value._version)
    if isinstance(value, (list, tuple)):
        return (id(value), len(value), tuple(_print(v) for v in value[:64]))
    return (id(value), value) if isinstance(value, (bool, int, float)) else id(value)


class _Trace:
    """Every value the local names of frames of `path` take, in order: (function, name) -> [(line, value)].
    A value is kept when it first appears or changes, with the line of the statement that set it (the line
    the frame ran last: a trace's line event comes before its statement runs)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.values: dict[tuple[str, str], list[tuple[int, Any]]] = {}
        self.order: list[tuple[str, str, int]] = []  # (function, name, index) in the order they were set
        self.lines: dict[int, str] = {}
        self._frames: dict[Any, tuple[int, dict]] = {}

    def __call__(self, frame, event, arg):
        if frame.f_code.co_filename != self.path:
            return None
        return self._local

    def _local(self, frame, event, arg):
        if event in ("line", "return"):
            self._look(frame)
            if event == "line":
                self._frames[frame] = (frame.f_lineno, self._frames[frame][1])
            else:
                self._frames.pop(frame, None)
        return self._local

    def _look(self, frame) -> None:
        entry = frame not in self._frames  # the arguments (and a comprehension's outer names): the caller's
        line, seen = self._frames.get(frame, (frame.f_code.co_firstlineno, {}))
        self._frames[frame] = (line, seen)
        for name, value in list(frame.f_locals.items()):
            mark = _print(value)
            if seen.get(name) == mark:
                continue
            seen[name] = mark
            if entry or any(c in self._source(frame, line) for c in CLOCKS):
                continue
            try:
                with _disable_current_modes():  # the copy is the judge's: no watch of the answer's may see it
                    kept = _kept(value)
            except Exception:  # a value that cannot be copied is not compared
                kept = None
            if kept is None:
                continue
            key = (frame.f_code.co_name, name)
            self._source(frame, line)  # kept for the verdict: the statement that set it
            self.values.setdefault(key, []).append((line, kept))
            self.order.append((*key, len(self.values[key]) - 1))

    def _source(self, frame, line: int) -> str:
        if line not in self.lines:
            planted = frame.f_globals.get("__planted_lines__")  # an audit's slip: the source as compiled
            lines = planted or linecache.getlines(self.path)
            self.lines[line] = lines[line - 1].strip() if 0 < line <= len(lines) else ""
        return self.lines[line]


def _storage(t: torch.Tensor) -> Any:
    try:
        return t.untyped_storage().data_ptr() if t.layout == torch.strided and not t.is_meta else None
    except Exception:  # a wrapper subclass: no storage of its own
        return None


def _summary(value: Any) -> tuple:
    """An op's output (or what a collective is handed) in a few numbers: each tensor's dtype, shape and the sum
    and the sum of magnitudes of its elements, enough to tell two outputs apart."""
    tensors = [v for v in (value if isinstance(value, (list, tuple)) else [value]) if isinstance(v, torch.Tensor)]
    told = []
    for t in tensors:
        sums = None
        if not (t.is_meta or is_traceable_wrapper_subclass(t)) and t.layout == torch.strided:
            try:
                d = t.detach().to("cpu", torch.float64) if not t.is_complex() else t.detach().abs().double()
                sums = (d.sum().item(), d.abs().sum().item())
            except Exception:  # a dtype with no double form
                sums = None
        told.append((str(t.dtype).removeprefix("torch."), tuple(t.shape), sums))
    return tuple(told)


class _Ops(TorchDispatchMode):
    """Every tensor operation a run performs, in order: (line of `path` that ran it, op, `_summary` of its
    output); ops run where no frame of `path` is on the stack are left out."""

    def __init__(self, trace: _Trace) -> None:
        super().__init__()
        self.trace, self.ops, self.arrived = trace, [], set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        collective = func.namespace == "c10d"
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)] if collective else []
        sent = None
        if collective:  # what a collective is handed, read before it runs (its output fills later)
            try:
                with _disable_current_modes():
                    sent = _summary(inputs)
            except Exception:
                sent = ()
        out = func(*args, **(kwargs or {}))
        name = func.__name__.removesuffix(".default")
        if func.namespace == "profiler" or name.split(".")[0] in BOOKKEEPING:
            return out
        if self.arrived and not collective:
            inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        with _disable_current_modes():
            if name.split(".")[0].endswith(("empty", "empty_like", "empty_strided", "new_empty")):
                for t in tree_leaves(out):  # both runs alike: what a buffer holds before it is filled
                    if isinstance(t, torch.Tensor) and t.layout == torch.strided and not t.is_meta:
                        t.zero_()
            if collective:  # what arrives from other ranks: a difference there is theirs
                self.arrived.update(_storage(t) for t in inputs)
        frame = sys._getframe(1)
        while frame is not None and frame.f_code.co_filename != self.trace.path:
            if frame.f_code.co_filename.startswith(JUDGE):  # the judge's own hook, watching the answer
                return out
            frame = frame.f_back
        if frame is not None:
            try:
                with _disable_current_modes():
                    told = sent if sent is not None else _summary(out)
            except Exception:  # an output that cannot be summed is told by its op alone
                told = ()
            arrived = any(_storage(t) in self.arrived for t in inputs)
            self.ops.append((frame.f_lineno, name, told, self.trace._source(frame, frame.f_lineno), arrived))
        return out


@contextlib.contextmanager
def _traced(trace: _Trace, ops: _Ops | None = None):
    before = sys.gettrace()
    sys.settrace(trace)
    try:
        if ops is None:
            yield
        else:
            with ops:
                yield
    finally:
        sys.settrace(before)


def _state(value: Any, label: str, depth: int = 0):
    """(label, kept value) for what a call can leave changed in its arguments: a tensor and its .grad, a
    module's parameters, their gradients and its buffers, and the same inside lists, tuples, dicts and plain
    objects' attributes, a few levels down."""
    if isinstance(value, torch.Tensor):
        yield label, _kept(value)
        if value.is_leaf and value.grad is not None:
            yield f"{label}.grad", _kept(value.grad)
    elif isinstance(value, torch.nn.Module):
        for name, param in value.named_parameters():
            yield from _state(param, f"{label}.{name}", 3)
        for name, buffer in value.named_buffers():
            yield f"{label}.{name}", _kept(buffer)
        for name, sub in value.named_modules():  # the objects a layer keeps (a layout, a plan), by their fields
            for k, v in vars(sub).items():
                if not k.startswith("_") and _plain(v):
                    yield f"{label}{'.' + name if name else ''}.{k}", _kept(v)
    elif depth >= 3:
        return
    elif isinstance(value, (list, tuple)) and len(value) <= 64:
        for k, v in enumerate(value):
            yield from _state(v, f"{label}[{k}]", depth + 1)
    elif isinstance(value, dict) and len(value) <= 64:
        for k, v in value.items():
            yield from _state(v, f"{label}[{k!r}]", depth + 1)
    elif type(value).__module__ != "builtins" and isinstance(getattr(value, "__dict__", None), dict):
        for k, v in list(vars(value).items())[:64]:
            if not k.startswith("_"):
                yield from _state(v, f"{label}.{k}", depth + 1)


def _after(fn: Callable[..., Any], args: tuple, kwargs: dict, returned: Any) -> dict[str, Any]:
    """What a call left behind: what it returned and its arguments' state (`_state`), by the parameters' names."""
    try:
        bound = inspect.signature(fn).bind(*args, **kwargs).arguments
    except (TypeError, ValueError):
        bound = {f"argument {k}": a for k, a in enumerate(args)} | kwargs
    left = dict(_state(returned, "what it returned"))
    for name, value in bound.items():
        left.update(_state(value, f"`{name}`"))
    return {k: v for k, v in left.items() if v is not None}


def _found(mine: _Trace, theirs: _Trace, ops: _Ops, their_ops: _Ops) -> str:
    """The first operation that departs, the first that computes otherwise where that is a later one, and the
    first name that departs, each where found."""
    first_op, first_name = op_departure(ops, their_ops), departure(mine, theirs)
    other = op_departure(ops, their_ops, values=False)
    said = [f"the first operation: {first_op}"] if first_op else []
    said += [f"the first other operation: {other}"] if other and other != first_op else []
    said += [f"the first name: {first_name}"] if first_name else []
    return "; ".join(said)


class Shadow:
    """An answer's function shadowed by the lesson's (module docstring): `wrap(fn)` runs the lesson's function
    on copies of each call's arguments, then the answer on the arguments themselves, both traced; `departs` is
    the first departure found (the rank's), "" while none is."""

    def __init__(
        self, lesson: Callable[..., Any], lesson_path: Path, answer_path: Path, agree: Callable[[bool], bool]
    ) -> None:
        self.lesson, self.lesson_path, self.answer_path = lesson, str(lesson_path), str(answer_path)
        self.agree = agree  # whether every rank says yes: the lesson's runs, with their collectives, in step
        # `after`: whether `departs` is only what the call left behind, not a difference while it ran
        self.departs, self.calls, self.broken, self.after = "", 0, False, False

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def shadowed(*args, **kwargs):
            # every rank shadows the same calls, a departure found or not: the lesson's collectives must pair
            if self.broken or self.calls >= CALLS:
                return fn(*args, **kwargs)
            self.calls += 1
            theirs = self._lesson(args, kwargs)
            if theirs is None:
                return fn(*args, **kwargs)
            (theirs, their_ops, left), mine, returned = theirs, _Trace(self.answer_path), None
            ops = _Ops(mine)
            try:
                with _traced(mine, ops):
                    returned = fn(*args, **kwargs)
                    return returned
            finally:  # an answer that raises is told where it departed before the raise
                with _disable_current_modes():
                    try:  # the describer never raises: what it cannot tell, it leaves out
                        found = "" if self.departs else _found(mine, theirs, ops, their_ops)
                        if not found and not self.departs and sys.exc_info()[0] is None:
                            found = effect(_after(fn, args, kwargs, returned), left)
                            self.after = bool(found)
                    except Exception:
                        found = ""
                if found:
                    self.departs = (f"in its call {self.calls}, " if self.calls > 1 else "") + found

        return shadowed

    def _lesson(self, args: tuple, kwargs: dict) -> tuple[_Trace, _Ops, dict] | None:
        """The lesson's run on copies, traced; None (and the shadow given up on every rank) where it cannot
        run. The copies' failure is agreed before the lesson runs a collective; its run's, after it."""
        try:
            with _disable_current_modes():
                copies = _copied((args, kwargs))
        except Exception as err:
            copies = err
        if not self.agree(not isinstance(copies, Exception)):
            self.broken = True
            return None
        state = torch.get_rng_state(), random.getstate()
        theirs, ran = _Trace(self.lesson_path), True
        their_ops = _Ops(theirs)
        try:
            with _disable_current_modes():
                with _traced(theirs, their_ops):
                    returned = self.lesson(*copies[0], **copies[1])
                left = _after(self.lesson, *copies, returned)
        except Exception:
            ran = False
        finally:
            torch.set_rng_state(state[0])
            random.setstate(state[1])
        if not self.agree(ran):
            self.broken = True
            return None
        return theirs, their_ops, left
