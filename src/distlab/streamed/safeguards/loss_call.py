"""The loss modules' guard: what one call was given, checked on this rank and agreed across ranks, or
the same error on every rank before the features are exchanged.

A loss module is called with features a forward already made, so there is one exchange of a few numbers
per call (`distlab.comm.agree`), before the gather or the ring: each rank's problem (a tensor that is not
C x d, a scale that is not one number, a `rank` or `world_size` that is not this rank's place in the
group), its C and d, its features' dtypes, its scale s and bias beta, and the settings that decide
which exchange runs (EXCHANGE, T). Every rank judges the same table, so either all of them go on to
the exchange or all of them raise: ranks holding different C (the gather and the ring need equal
shares), features of different widths or dtypes, replicas whose s or beta drifted apart, or ranks
configured for different exchanges (one in the ring while another gathers would wait forever).

The same table says which call this is: the module (numbered in the order this process's loss modules
first exchanged), how many times it was called, and whether gradients are on. A loss called on some ranks
only (an extra validation call on rank 0) pairs with another call elsewhere: a different module, count or
grad mode, and every rank raises naming each rank's call, rather than exchanging features of different
batches. (An extra call with gradients on, of the same module, pairs with the other ranks' next call and
cannot be told apart here; its rank is the one left waiting at the end.) A rank whose peers never make the
call waits in the exchange until they leave or the group's timeout passes, and raises naming its call,
never hangs silently.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from distlab.comm.agree import message_length, per_rank, raise_together, rank_table
from distlab.streamed.config import EXCHANGES

FIELDS = (
    *("problem", "module", "call", "grad", "C", "d_x", "d_y", "dtype_x", "dtype_y"),
    *("scale", "has_bias", "bias", "EXCHANGE", "T"),
)
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
NOT_KNOWN = float("nan")


@dataclass(frozen=True)
class Call:
    """What a loss module was called with, and where it runs."""

    z_x: Any  # image_features, C x d on this rank
    z_y: Any  # text_features
    s: Any  # logit_scale: a one-element tensor or a number
    beta: Any  # logit_bias: None, a one-element tensor or a number
    exchange: str  # "gather" or "ring"
    t: int  # T, the side of a tile
    group: Any = None  # the process group (None: the world)
    module: int = 0  # which loss module (numbered in the order of their first exchange)
    count: int = 0  # the module's calls so far, this one included


def as_number(v: Any) -> float:
    """A one-element tensor or a real number as a float (its value, no graph)."""
    return float(v.detach().double().reshape(())) if isinstance(v, torch.Tensor) else float(v)


def device_of(call: Call) -> torch.device:
    """Where the small exchange runs: the features' device (on GPUs the nccl side of the group)."""
    return call.z_x.device if isinstance(call.z_x, torch.Tensor) else torch.device("cpu")


def _one_number(name: str, v: Any) -> str | None:
    if isinstance(v, torch.Tensor):
        if v.numel() != 1 or not v.is_floating_point():
            return f"{name} must be a one-element floating tensor or a number, got shape {tuple(v.shape)} {v.dtype}"
        return None
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        return f"{name} must be a one-element floating tensor or a number, got {type(v).__name__}"
    return None


def local_problem(call: Call, claimed: tuple[int, int], needs_bias: bool, place: tuple | None = None) -> str | None:
    """What this rank alone can see is wrong with the call (None: nothing). `claimed`: the rank and
    world_size the module was constructed with (open_clip's args.rank, args.world_size); `place`: this
    process's (rank, size) in the group (None: read from the group)."""
    for name, z in (("image_features", call.z_x), ("text_features", call.z_y)):
        if not isinstance(z, torch.Tensor) or z.dim() != 2 or not z.is_floating_point():
            what = f"shape {tuple(z.shape)} {z.dtype}" if isinstance(z, torch.Tensor) else type(z).__name__
            return f"{name} must be a floating tensor of shape (C, d), got {what}"
    if call.z_x.shape != call.z_y.shape:
        return (
            f"image_features and text_features must both be C x d, got {tuple(call.z_x.shape)} "
            f"and {tuple(call.z_y.shape)}"
        )
    if call.z_x.shape[0] == 0:
        return "the features hold no pair (C = 0)"
    if needs_bias and call.beta is None:
        return "SigLipLoss needs the logit_bias (the sigmoid loss's beta), as open_clip's SigLipLoss does"
    problem = _one_number("logit_scale", call.s)
    if problem is None and call.beta is not None:
        problem = _one_number("logit_bias", call.beta)
    if problem is None:
        place = place or (dist.get_rank(call.group), dist.get_world_size(call.group))
        if tuple(claimed) != place:
            problem = (
                f"the loss was built with rank={claimed[0]}, world_size={claimed[1]}, but this process is rank "
                f"{place[0]} of {place[1]} in its process group (pass args.rank and args.world_size as open_clip does)"
            )
    return problem


def _row(call: Call, problem: str | None) -> list[float]:
    row = dict.fromkeys(FIELDS, NOT_KNOWN)
    row.update(problem=message_length(problem), EXCHANGE=EXCHANGES.index(call.exchange), T=call.t)
    row.update(module=call.module, call=call.count, grad=float(torch.is_grad_enabled()))
    if problem is None:
        row.update(
            C=call.z_x.shape[0],
            d_x=call.z_x.shape[1],
            d_y=call.z_y.shape[1],
            dtype_x=DTYPES.index(call.z_x.dtype) if call.z_x.dtype in DTYPES else -1,
            dtype_y=DTYPES.index(call.z_y.dtype) if call.z_y.dtype in DTYPES else -1,
            scale=as_number(call.s),
            has_bias=float(call.beta is not None),
            bias=as_number(call.beta) if call.beta is not None else NOT_KNOWN,
        )
    return [row[k] for k in FIELDS]


def _call_text(module: float, count: float, grad: float) -> str:
    return f"module {module:g} call {count:g}{'' if grad else ' under no_grad'}"


def agree(call: Call, problem: str | None) -> None:
    """One exchange over the group: return on every rank, or raise the same ValueError on every rank."""
    device = device_of(call)
    try:
        table = rank_table(_row(call, problem), device, call.group)
    except RuntimeError as err:  # the group's timeout, or a peer gone: this call found no partner
        raise RuntimeError(
            f"loss module {call.module}, call {call.count}: the other ranks did not make this call ({err}): a loss "
            "called on some ranks only (every rank must call each loss module equally often, in the same order), "
            "or a rank that stopped"
        ) from err
    column = {key: table[:, FIELDS.index(key)].tolist() for key in FIELDS}
    calls = list(zip(column["module"], column["call"], column["grad"]))
    if len(set(calls)) > 1:
        said = per_rank(range(len(calls)), lambda r: _call_text(*calls[int(r)]))
        raise ValueError(
            f"the ranks are in different loss calls ({said}): a loss called on some ranks only (every rank must "
            "call each loss module equally often, in the same order, under the same grad mode)"
        )
    raise_together(problem, device, lengths=column["problem"], group=call.group)
    names = {
        "EXCHANGE": ("the exchange", lambda v: EXCHANGES[int(v)]),
        "T": ("stream_chunk_size T", lambda v: f"{v:g}"),
        "C": ("the pairs C each rank holds (the gather and the ring need equal shares)", lambda v: f"{v:g}"),
        "d_x": ("the width of image_features", lambda v: f"{v:g}"),
        "d_y": ("the width of text_features", lambda v: f"{v:g}"),
        "dtype_x": ("image_features' dtype", lambda v: str(DTYPES[int(v)]) if v >= 0 else "other"),
        "dtype_y": ("text_features' dtype", lambda v: str(DTYPES[int(v)]) if v >= 0 else "other"),
        "has_bias": ("whether a logit_bias was passed", lambda v: str(bool(v))),
    }
    for key, (words, fmt) in names.items():
        if len(set(column[key])) > 1:
            raise ValueError(f"{words} differs across ranks: {per_rank(column[key], fmt)}")
    scales = column["scale"]
    if not all(math.isfinite(v) and v > 0 for v in scales) or len(set(scales)) > 1:
        raise ValueError(
            "the logit scale must be finite, > 0 and the same on every rank (replicas in sync): "
            f"{per_rank(scales, repr)}"
        )
    biases = column["bias"]
    if column["has_bias"][0] == 1.0 and (not all(math.isfinite(v) for v in biases) or len(set(biases)) > 1):
        raise ValueError(f"the logit bias must be finite and the same on every rank: {per_rank(biases, repr)}")
