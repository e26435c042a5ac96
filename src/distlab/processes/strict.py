"""Strict device mode: a collective on a tensor that is not on the runtime's device raises.

The rule (docs/running.md, "The two commands"): every collective runs on the rank's device, `rt.device`. On
GPUs a tensor left on the CPU breaks it (an nccl group refuses it; `cpu:gloo,cuda:nccl` quietly sends
it through gloo, and a gather that mixes the two devices fails), yet a CPU-only suite cannot see it:
there `rt.device` *is* the CPU.

The idea: give the CPU two names. In strict mode on CPU `rt.device` is `cpu:0`, the stand-in for
`cuda:LOCAL_RANK`; plain `cpu` is the host, where an unplaced tensor lives on a GPU machine. Both
compute on the CPU but compare unequal, and a TorchFunctionMode tells which one each storage (views
share it) would be on:

    host:    made without a device (torch.tensor, zeros, arange, from_numpy, ..., hence the parameters
             of a module built without one), with device="cpu", or by .cpu() / .to("cpu");
    placed:  made with device=rt.device, or moved there (.to(rt.device), module.to(rt.device));
    an op:   placed if any tensor input is placed, host if all are; views and in-place results keep
             their storage's. Tensors made in C++ (autograd, DDP, unpickling) are unknown.

`t.device` answers `cpu` for a host tensor and `rt.device` otherwise, so `device=t.device` and
`t.device == rt.device` behave as on a GPU, and `.to`/`.cpu` copy when a GPU would. A
`StrictDeviceError` naming the call and both devices refuses a host tensor in a tensor collective of
`torch.distributed` (wrapped while the mode is on), in a functional collective
(`torch.ops._c10d_functional`) or in a module given to DDP, and an op mixing a host tensor with a
placed one, as a GPU would (0-dim host tensors, indices, copies and moves pass, as on GPUs). On a GPU
machine strict mode compares the real devices. On with `distributed(..., strict=True)` or
`DISTLAB_STRICT_DEVICE=1` (tests: `strict_device(rt)`); off, it costs nothing: nothing is patched.

Limits, honestly: unknown tensors pass every check; tensors made in a backward pass are unknown, and
collectives run from C++ (DDP's all-reduce) are checked through DDP's constructor only; a device
named by its type alone ("cpu", `rt.device.type`) counts as the host, though on a GPU
`rt.device.type` is the current GPU; `torch.set_default_device`, legacy constructors
(`torch.Tensor(...)`) and names bound before the mode began (`from torch.distributed import
all_reduce`) are not followed. Object collectives are exempt: torch moves their tensors itself.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.nn.parallel import DistributedDataParallel
from torch.overrides import TorchFunctionMode, resolve_name
from torch.utils._pytree import tree_leaves, tree_map

from distlab.processes.identity import Runtime

HOST = torch.device("cpu")
STAND_IN = torch.device("cpu", 0)  # rt.device in strict mode on CPU: the GPU's stand-in
TENSOR_COLLECTIVES = (
    "broadcast",
    "all_reduce",
    "all_reduce_coalesced",
    "reduce",
    "all_gather",
    "all_gather_single",
    "all_gather_into_tensor",
    "all_gather_coalesced",
    "gather",
    "scatter",
    "reduce_scatter",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
)
OBJECT_COLLECTIVES = (
    "all_gather_object",
    "gather_object",
    "broadcast_object_list",
    "scatter_object_list",
    "send_object_list",
    "recv_object_list",
)
FUNCTIONAL_NAMESPACES = ("_c10d_functional.", "_c10d_functional_autograd.")
# Ops that take host tensors beside device ones on a GPU too: indices, copies, moves, split points.
MIXING_ALLOWED = {  # (a fresh `data.__set__` equals the one here)
    torch.Tensor.__getitem__,
    torch.Tensor.__setitem__,
    torch.Tensor.index_put_,
    torch.Tensor.index_put,
    torch.index_put,
    torch.Tensor.copy_,
    torch.Tensor.to,
    torch.Tensor.new_tensor,
    torch.Tensor.type_as,
    torch.tensor_split,
    torch.Tensor.tensor_split,
    torch.Tensor.data.__set__,
    torch.is_same_size,
    torch._has_compatible_shallow_copy_type,
}
_TAG = "_distlab_host"  # on a storage's Python object: True host, False placed, absent unknown
_DEVICE = torch.Tensor.device  # the property; `t.device` reaches the mode as its (fresh) __get__
_state = threading.local()  # .active; .exempt: depth of object collectives on this thread


class StrictDeviceError(RuntimeError):
    """A collective, DDP or an op was given a tensor that is not on the runtime's device."""


# --- which device a tensor would be on -------------------------------------------------------------


def _storage(t: torch.Tensor) -> torch.UntypedStorage | None:
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # a wrapper subclass: AsyncCollectiveTensor holds .elem
        inner = getattr(t, "elem", None)
        return _storage(inner) if isinstance(inner, torch.Tensor) else None


def _key(t: torch.Tensor) -> int | None:
    return getattr(_storage(t), "_cdata", None)  # one per storage: views and in-place results share it


def _tag(t: torch.Tensor) -> bool | None:
    return getattr(_storage(t), _TAG, None)


def is_host(t: torch.Tensor) -> bool:
    """True when strict mode saw `t` made, or moved, where a GPU machine would keep it on the CPU."""
    return _tag(t) is True


def _mark(t: torch.Tensor, host: bool) -> None:
    storage = _storage(t)
    if storage is not None and _DEVICE.__get__(t).type == "cpu":
        setattr(storage, _TAG, host)


def _names_host(device: Any) -> bool:
    """Would `device=...` put the tensor on the host? None is the default device: the host."""
    device = torch.device(device) if device is not None else HOST
    return device.type == "cpu" and device != STAND_IN


class _Follow(TorchFunctionMode):
    """Follows host vs placed through every torch call; answers `t.device`; refuses mixed ops and
    functional collectives on host tensors."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device = device

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__self__", None) is _DEVICE and func.__name__ == "__get__":
            real = func(*args)
            return real if real.type != "cpu" else HOST if is_host(args[0]) else self.device
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        tags = [_tag(t) for t in inputs]
        explicit = kwargs.get("device") is not None
        if isinstance(func, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
            # Ops at this level also arrive from inside dispatch modes (PeakMemory), with every device
            # already resolved to cpu: only the functional collectives are ours to check and follow.
            if not str(func).startswith(FUNCTIONAL_NAMESPACES):
                return func(*args, **kwargs)
            check(str(func), inputs, self.device)
        elif False in tags and not explicit and func not in MIXING_ALLOWED:
            stray = [t for t, tag in zip(inputs, tags) if tag and t.dim() > 0]  # 0-dim: a GPU takes it
            if stray:
                check(f"{resolve_name(func) or func} (beside a tensor on {self.device})", stray, self.device)
        if func is torch.Tensor.to or func is torch.Tensor.cpu:
            return self._move(func, args, kwargs)
        out = func(*args, **kwargs)
        if explicit:
            return _retarget(out, inputs, _names_host(kwargs["device"]))
        if not inputs or False in tags or all(tags):  # made on the default device, or followed
            shared = {_key(t) for t in inputs}
            host = False not in tags
            for o in tree_leaves(out):
                if isinstance(o, torch.Tensor) and _key(o) not in shared:
                    _mark(o, host)
        return out

    def _move(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        """`.cpu()` and `.to(...)` as a GPU would run them: to the host or to rt.device, copying when
        the device changes. The real call never changes the device (both names are the CPU)."""
        src = args[0]
        if func is torch.Tensor.cpu:
            return _retarget(src.to(memory_format=kwargs.get("memory_format", torch.preserve_format)), [src], host=True)
        other = next((a for a in (*args[1:], kwargs.get("other")) if isinstance(a, torch.Tensor)), None)
        device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*args[1:], **kwargs)
        if _DEVICE.__get__(src).type != "cpu" or (device is not None and device.type != "cpu"):
            out = func(*args, **kwargs)  # a real move (meta, cuda): only its CPU results are followed
            return out if device is None or device.type != "cpu" else _retarget(out, [src], _names_host(device))
        if other is not None:
            host = is_host(other)
        else:
            host = is_host(src) if device is None else _names_host(device)
        out = src.to(
            dtype=dtype,
            non_blocking=non_blocking,
            copy=kwargs.get("copy", False),
            memory_format=memory_format or torch.preserve_format,
        )
        return _retarget(out, [src], host)


def _retarget(out: Any, inputs: list[torch.Tensor], host: bool) -> Any:
    """Put every tensor of `out` on the host, or on the device; one that shares the storage of an
    input not known to be there already is copied first, as a GPU's cross-device copy would be."""
    elsewhere = {_key(t) for t in inputs if _tag(t) is not host} - {None}

    def one(o: Any) -> Any:
        if isinstance(o, torch.Tensor):
            o = o.clone() if _key(o) in elsewhere else o
            _mark(o, host)
        return o

    return tree_map(one, out)


# --- the checks ------------------------------------------------------------------------------------


def device_of(t: torch.Tensor, device: torch.device) -> torch.device:
    """The device `t` would be on, with `device` the runtime's (STAND_IN simulates a GPU on CPU)."""
    real = _DEVICE.__get__(t)
    if device == STAND_IN and real.type == "cpu":
        return HOST if is_host(t) else STAND_IN
    return real


def check(what: str, tensors: Iterable[torch.Tensor], device: torch.device) -> None:
    """Raise StrictDeviceError unless every tensor is on `device`, the runtime's."""
    for t in tensors:
        where = device_of(t, device)
        if where != device:
            stand_in = (
                f" ({STAND_IN} stands in for the GPU in strict mode on CPU, and {HOST} is the host, "
                "where a tensor made without device=... lives on a GPU machine)"
                if device == STAND_IN
                else ""
            )
            raise StrictDeviceError(
                f"{what} got a tensor of shape {list(t.shape)} on {where}, but the runtime's device is "
                f"{device}{stand_in}: make it with device=rt.device or move it with .to(rt.device)"
            )


def _tensors_in(value: Any) -> Iterator[torch.Tensor]:
    """The tensors of a collective's arguments: tensors, lists of them, P2POps."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dist.P2POp):
        yield value.tensor
    elif isinstance(value, (list, tuple, dict)):
        for item in value.values() if isinstance(value, dict) else value:
            yield from _tensors_in(item)


def _checked(name: str, fn: Callable, device: torch.device) -> Callable:
    @functools.wraps(fn)
    def collective(*args: Any, **kwargs: Any) -> Any:
        if not getattr(_state, "exempt", 0):  # inside an object collective: torch placed its tensors
            check(f"torch.distributed.{name}", _tensors_in((args, kwargs)), device)
        return fn(*args, **kwargs)

    collective.strict_device = True  # tells tests (and the curious) that the wrapper is installed
    return collective


def _exempt(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def object_collective(*args: Any, **kwargs: Any) -> Any:
        _state.exempt = getattr(_state, "exempt", 0) + 1
        try:
            return fn(*args, **kwargs)
        finally:
            _state.exempt -= 1

    return object_collective


def _made_on_host(fn: Callable) -> Callable:
    """torch.from_numpy and torch.frombuffer bypass the mode; their tensors share CPU memory."""

    @functools.wraps(fn)
    def factory(*args: Any, **kwargs: Any) -> torch.Tensor:
        out = fn(*args, **kwargs)
        _mark(out, host=True)
        return out

    return factory


def _checked_ddp(init: Callable, device: torch.device) -> Callable:
    @functools.wraps(init)
    def __init__(self, module, *args: Any, **kwargs: Any) -> None:
        for kind, named in (("parameter", module.named_parameters()), ("buffer", module.named_buffers())):
            for name, t in named:
                check(f"DistributedDataParallel ({kind} {name!r} of {type(module).__name__})", [t], device)
        init(self, module, *args, **kwargs)

    return __init__


@contextmanager
def _patched(patches: list[tuple[Any, str, Any]]) -> Iterator[None]:
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    try:
        for owner, name, value in patches:
            setattr(owner, name, value)
        yield
    finally:
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)


@contextmanager
def strict_device(rt: Runtime) -> Iterator[Runtime]:
    """Strict device mode for the block; yields the runtime to use in it (on CPU, device `cpu:0`).

    Both `torch.distributed` and its `distributed_c10d` module get the wrappers, so
    `dist.P2POp(dist.isend, ...)` still recognises its op; DDP's constructor is wrapped too."""
    if getattr(_state, "active", False):
        raise RuntimeError("strict device mode is already on")
    simulate = rt.device.type == "cpu"
    srt = dataclasses.replace(rt, device=STAND_IN) if simulate else rt
    patches = [(DistributedDataParallel, "__init__", _checked_ddp(DistributedDataParallel.__init__, srt.device))]
    for name in TENSOR_COLLECTIVES + OBJECT_COLLECTIVES:
        if hasattr(c10d, name):
            original = getattr(c10d, name)
            wrapped = _exempt(original) if name in OBJECT_COLLECTIVES else _checked(name, original, srt.device)
            patches += [(owner, name, wrapped) for owner in (c10d, dist) if getattr(owner, name, None) is original]
    if simulate:
        patches += [(torch, name, _made_on_host(getattr(torch, name))) for name in ("from_numpy", "frombuffer")]
    _state.active = True
    try:
        with _patched(patches), _Follow(srt.device) if simulate else nullcontext():
            yield srt
    finally:
        _state.active = False
