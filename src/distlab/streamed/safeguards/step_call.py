"""The streamed step's call, guarded: one call returns a step every rank agreed to run, or raises the same error
on every rank.

A collective that only some ranks reach waits for the others until the process group's timeout. A
forward can be such a collective: DDP's forward with grad broadcasts the module's buffers (BatchNorm's
running statistics, open_clip's attention mask) and, once, rebuilds its buckets; FSDP2's all-gathers
the parameters. So no rank leaves early (`distlab.comm.agree`: every rank judges one exchanged table):

1. `ready_step`, before any rank's forward: the config, the wrapper, a trainable parameter,
   BatchNorm, checked locally; then one all-gather of a few numbers per rank (N, B, TAU or
   the learnable mode, NORMALISERS, the rank's pair counts, "I found a problem"). A config that
   differs across ranks (a silently wrong gradient, or ranks in different regimes whose forwards
   communicate differently), a rank whose batch is not N / P, or any rank's local problem: every
   rank raises here. Otherwise it returns a `Ready` step.
2. `Ready.agreed_outputs`, phase 1's forward run inside the guard: the embedding widths and dtypes,
   the logit scale s (finite, positive, the same on every rank), and whether the forward raised or
   returned something outside the contract on some rank (that rank still joins the exchange).

(The values that come after, a non-finite loss or gradient, are `finite`'s.) Every exchange runs over the
wrapper's process group (a DDP subgroup: its ranks only). A ValueError for bad input; a RuntimeError when
model(x, y) itself raised on some rank (on that rank chained to the original). A rank without a process group
raises at once (there is no one to tell). Under FSDP2 a forward that raises on one rank can leave the others
inside FSDP2's own all-gathers.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from distlab.comm.agree import message_length, per_rank, raise_together, rank_table
from distlab.pieces.split_inputs import samples_in
from distlab.streamed.config import EXCHANGES, KERNELS, MATMUL_PRECISIONS, NORMALISERS, StreamConfig, parse_config
from distlab.streamed.kernel_choice import kernels_problem
from distlab.streamed.safeguards.exit_hint import hinting_release
from distlab.streamed.safeguards.peers import naming_dead_peers
from distlab.streamed.wrappers import Wrapped, batchnorm_in_training, first_device, trainable, unwrap

DTYPE_CODES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
BEFORE = ("problem", "N", "B", "TAU", "NORMALISERS", "EXCHANGE", "KERNELS", "MATMUL_PRECISION", "rows_x", "rows_y")
AFTER = ("problem", "raised", "d_x", "d_y", "dtype_x", "dtype_y", "scale", "has_bias", "bias")
NOT_KNOWN = float("nan")
LEARNABLE = 0.0  # the TAU field of a rank whose model returns its own logit scale
KEY_NAMES = {"N": "GLOBAL_BATCH_SIZE N", "B": "MICRO_BATCH_SIZE B"}  # as the caller typed them
Outputs = tuple  # (z_x, z_y, s or None, beta or None), one micro-batch's


@dataclass(frozen=True)
class Ready:
    """A step every rank agreed to run: its config, the wrapper, what the wrapper divides the summed
    gradient by (read once, here, where a bad wrapper is refused on every rank), and the device the
    small exchanges run on."""

    cfg: StreamConfig
    wrapped: Wrapped
    factor: float
    device: torch.device

    @property
    def group(self) -> Any:
        """The process group every exchange of the step runs over: the wrapper's."""
        return self.cfg.group

    def agreed_outputs(self, forward: Callable[[], list], rows: list[int]) -> list[Outputs]:
        """Run phase 1's `forward` (one output per micro-batch of `rows` pairs), check what it returned,
        and agree across ranks: the checked (z_x, z_y, s or None) per micro-batch, or the same error
        on every rank. A rank whose forward raised still joins the exchange, then every rank raises."""
        try:
            raw = forward()
        except Exception as err:  # noqa: BLE001 - this rank joins the exchange before anyone raises
            _agree_after_forward(self, None, f"model(x, y) raised {type(err).__name__}: {err}", err)
        try:
            outputs = [check_outputs(out, n, self.cfg) for out, n in zip(raw, rows)]
        except ValueError as err:
            _agree_after_forward(self, None, str(err), None)
        _agree_after_forward(self, outputs[0], None, None)
        return outputs


@contextmanager
def guarded_step(model: Any) -> Iterator[None]:
    """Around the whole step: a peer that dies in one of its exchanges (over the wrapper's group) is named on the
    survivors, not echoed (`peers`), and every error ends with how to exit cleanly (`exit_hint`)."""
    with hinting_release(), naming_dead_peers(exchange_group(model)):
        yield


def ready_step(model: Any, local_x: Any, local_y: Any, config: Mapping[str, Any]) -> Ready:
    """The checks before any rank's forward: a `Ready` step on every rank, or the same error on every
    rank. Raises at once only when there is no process group to join (and so no one to hang)."""
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(
            "the streamed step needs an initialised process group: launch with torchrun "
            "and call torch.distributed.init_process_group first"
        )
    try:
        ready, problem = _check_locally(model, local_x, local_y, config), None
        device, group = ready.device, ready.group
    except ValueError as err:
        ready, problem = None, str(err)
        inner, group = _inner_and_group(model)
        device = first_device(inner, local_x)
    _agree_before_forward(ready, problem, (local_x, local_y), device, group)
    return ready


def exchange_group(model: Any) -> Any:
    """The process group the step's exchanges run over: the wrapper's, or the world for a model the
    step does not know (which every rank refuses together)."""
    return _inner_and_group(model)[1]


def _inner_and_group(model: Any) -> tuple[Any, Any]:
    """The wrapped module and the wrapper's group, when the wrapper is one the step knows (its
    parameters' device is where the exchanges run), else (None, the world)."""
    try:
        wrapped = unwrap(model)
        return wrapped.inner, wrapped.group
    except ValueError:
        return None, dist.group.WORLD


def _check_locally(model: Any, local_x: Any, local_y: Any, config: Mapping[str, Any]) -> Ready:
    """What this rank alone can check; raises ValueError (which `ready_step` exchanges, not raises)."""
    if not torch.is_grad_enabled():
        raise ValueError(
            "the streamed step was called with gradients disabled (inside torch.no_grad()?): it computes a gradient"
        )
    wrapped = unwrap(model)
    group = wrapped.group
    cfg = parse_config(config, dist.get_world_size(group), dist.get_rank(group), group)
    rows_x, rows_y = samples_in(local_x, "local_x"), samples_in(local_y, "local_y")  # the key that is wrong, named
    if rows_x != rows_y:
        raise ValueError(f"local_x and local_y must hold the same number of pairs, got {rows_x} and {rows_y}")
    if not trainable(wrapped.inner):
        raise ValueError(
            f"no parameter of {type(wrapped.inner).__name__} requires grad: there is nothing for the step to train"
        )
    bn = batchnorm_in_training(wrapped.inner)
    if bn and not cfg.one_forward:
        raise ValueError(
            f"BatchNorm in training mode ({', '.join(bn[:3])}) with MICRO_BATCH_SIZE B={cfg.b} < "
            f"C=N/P={cfg.local}: each micro-batch would be normalised over its own B rows instead "
            "of the rank's C, and the running statistics updated twice per micro-batch (the "
            "no-grad pass and the recompute). Use B >= C (one forward, exactly plain DDP), put "
            "BatchNorm in eval mode, or use a normalisation that does not mix samples "
            "(LayerNorm, GroupNorm)"
        )
    if wrapped.static_graph and not cfg.one_forward:
        raise ValueError(
            f"DDP(static_graph=True) with MICRO_BATCH_SIZE B={cfg.b} < C=N/P={cfg.local}: the "
            "recompute runs every micro-batch's backward but the last under no_sync(), which "
            "a static-graph DDP does not support. Use B >= C (one forward) or DDP without "
            "static_graph"
        )
    device = first_device(wrapped.inner, local_x)
    if (problem := kernels_problem(cfg.kernels, device)) is not None:
        raise ValueError(problem)
    return Ready(cfg, wrapped, wrapped.reduction_factor, device)


OPEN_CLIP_KEYS = ("image_features", "text_features", "logit_scale", "logit_bias")  # open_clip's output_dict=True


def as_outputs(out: Any) -> Any:
    """forward's result as (z_x, z_y, s or None, beta or None): a tuple or list of 2, 3 or 4 (a fourth,
    open_clip's logit_bias, selects the sigmoid loss), or open_clip's dict (output_dict=True) by its keys;
    anything else is left for `check_outputs` to describe."""
    if isinstance(out, dict):
        extra = [k for k in out if k not in OPEN_CLIP_KEYS]
        if "image_features" in out and "text_features" in out and not extra:
            return tuple(out.get(k) for k in OPEN_CLIP_KEYS)
        return out
    if isinstance(out, (tuple, list)) and len(out) in (2, 3, 4):
        return tuple(out) + (None,) * (4 - len(out))
    return out


def _describe(out: Any) -> str:
    """What forward returned, in a few words."""
    if isinstance(out, dict):
        return (
            f"a dict with keys {list(out)[:6]} (the step reads open_clip's output_dict: "
            f"{', '.join(OPEN_CLIP_KEYS)}, nothing else)"
        )
    if isinstance(out, (tuple, list)):
        return f"a {type(out).__name__} of {len(out)}: ({', '.join(type(z).__name__ for z in out[:4])})"
    return type(out).__name__


def check_outputs(out: Any, rows: int, cfg: StreamConfig) -> Outputs:
    """forward(x, y) must return (z_x, z_y), (z_x, z_y, s) (the InfoNCE) or (z_x, z_y, s, beta) (the sigmoid
    loss), or open_clip's dict of them: z of `rows` x d, floating point, one width; s and beta one-element
    tensors, and then config must not hold TAU. Returns (z_x, z_y, s or None, beta or None)."""
    raw, out = out, as_outputs(out)
    if not (
        isinstance(out, tuple)
        and len(out) == 4
        and all(isinstance(z, torch.Tensor) for z in out[:2])
        and all(z is None or isinstance(z, torch.Tensor) for z in out[2:])
        and not (out[3] is not None and out[2] is None)
    ):
        raise ValueError(
            f"model(x, y) must return (z_x, z_y), (z_x, z_y, logit_scale) or (z_x, z_y, logit_scale, "
            f"logit_bias) as tensors, or open_clip's dict of them, got {_describe(raw)}"
        )
    z_x, z_y, s, beta = out
    if z_x.dim() != 2 or z_y.dim() != 2 or z_x.shape[1] != z_y.shape[1] or len(z_x) != rows or len(z_y) != rows:
        raise ValueError(
            f"model(x, y) must return z_x and z_y of shape (batch, d) with batch {rows} and "
            f"one d, got {tuple(z_x.shape)} and {tuple(z_y.shape)}"
        )
    if not (z_x.is_floating_point() and z_y.is_floating_point()):
        raise ValueError(f"embeddings must be floating point, got {z_x.dtype} and {z_y.dtype}")
    for name, v in (("scale", s), ("bias", beta)):
        if v is not None and (v.numel() != 1 or not v.is_floating_point()):
            raise ValueError(
                f"the logit {name} model(x, y) returns must be a one-element floating "
                f"tensor, got shape {tuple(v.shape)} {v.dtype}"
            )
    if s is not None and cfg.tau is not None:
        raise ValueError(
            f"config holds TAU={cfg.tau}, but the model returns its own logit scale: "
            "leave TAU out of the config (the logits are s * z_x z_y^T with the model's s)"
        )
    if s is None and cfg.tau is None:
        raise ValueError(
            "config has no TAU and the model returns no logit scale: pass TAU, or return "
            "(z_x, z_y, logit_scale) from forward"
        )
    return z_x, z_y, s, beta


def _agree_before_forward(
    ready: Ready | None, problem: str | None, batches: tuple, device: torch.device, group: Any
) -> None:
    """Config, pair counts and local problems, before any rank's forward: the same error on every rank
    of `group`, or return."""
    row = dict.fromkeys(BEFORE, NOT_KNOWN)
    row["problem"] = message_length(problem)
    if ready is not None:
        cfg = ready.cfg
        row.update(
            N=cfg.n,
            B=cfg.b,
            TAU=LEARNABLE if cfg.tau is None else cfg.tau,
            NORMALISERS=NORMALISERS.index(cfg.normalisers),
            EXCHANGE=EXCHANGES.index(cfg.exchange),
            KERNELS=KERNELS.index(cfg.kernels),
            MATMUL_PRECISION=MATMUL_PRECISIONS.index(cfg.precision),
        )
    for key, batch in zip(("rows_x", "rows_y"), batches):
        row[key] = _samples_or_unknown(batch)
    table = rank_table([row[k] for k in BEFORE], device, group)
    column = {key: table[:, BEFORE.index(key)].tolist() for key in BEFORE}
    names = {
        "TAU": lambda v: "learnable scale" if v == LEARNABLE else f"{v:g}",
        "NORMALISERS": lambda v: NORMALISERS[int(v)],
        "EXCHANGE": lambda v: EXCHANGES[int(v)],
        "KERNELS": lambda v: KERNELS[int(v)],
        "MATMUL_PRECISION": lambda v: MATMUL_PRECISIONS[int(v)],
    }
    for key in ("N", "B", "TAU", "NORMALISERS", "EXCHANGE", "KERNELS", "MATMUL_PRECISION"):
        if _differ(column[key]):
            raise ValueError(
                f"config differs across ranks, {KEY_NAMES.get(key, key)}: "
                f"{per_rank(column[key], names.get(key, lambda v: f'{v:g}'))}; "
                "every rank must pass the same config"
            )
    raise_together(problem, device, lengths=column["problem"], group=group)
    cfg = ready.cfg
    if any(r != cfg.local for r in column["rows_x"]):
        raise ValueError(
            f"every rank must hold N / P = {cfg.n} / {cfg.world} = {cfg.local} pairs, but "
            f"{per_rank(column['rows_x'])} (is N right, and does every rank get an equal share, "
            "e.g. a DistributedSampler with drop_last=True?)"
        )


def _agree_after_forward(
    ready: Ready, out: Outputs | None, problem: str | None, raised: BaseException | None
) -> None | NoReturn:
    """After phase 1's forward, before the first all-gather: this rank's first micro-batch's checked
    outputs `out`, or its `problem` (then every rank raises; `raised`: what model(x, y) raised)."""
    row = dict.fromkeys(AFTER, NOT_KNOWN)
    row.update(problem=message_length(problem), raised=float(raised is not None))
    if out is not None:
        z_x, z_y, s, beta = out
        row.update(
            d_x=z_x.shape[1],
            d_y=z_y.shape[1],
            dtype_x=_dtype_code(z_x),
            dtype_y=_dtype_code(z_y),
            scale=_value(s),
            has_bias=float(beta is not None),
            bias=_value(beta),
        )
    table = rank_table([row[k] for k in AFTER], ready.device, ready.group)
    column = {key: table[:, AFTER.index(key)].tolist() for key in AFTER}
    error = RuntimeError if any(v == 1.0 for v in column["raised"]) else ValueError
    raise_together(problem, ready.device, error, raised, lengths=column["problem"], group=ready.group)
    for key in ("d_x", "d_y", "dtype_x", "dtype_y", "has_bias"):
        if _differ(column[key]):
            fmt = (lambda v: str(DTYPE_CODES[int(v)]) if v >= 0 else "other") if "dtype" in key else None
            raise ValueError(
                f"the embeddings differ across ranks, {key}: "
                f"{per_rank(column[key], fmt) if fmt else per_rank(column[key])}"
            )
    if ready.cfg.tau is None:
        scales = column["scale"]
        if not all(math.isfinite(v) and v > 0 for v in scales):
            raise ValueError(
                f"the logit scale s the model returns must be finite and > 0 on every rank: {per_rank(scales, repr)}"
            )
        if len(set(scales)) > 1:
            raise ValueError(
                f"the logit scale s differs across ranks ({per_rank(scales, repr)}): the replicas are out of sync"
            )
    biases = column["bias"]
    if column["has_bias"][0] == 1.0 and (not all(math.isfinite(v) for v in biases) or len(set(biases)) > 1):
        raise ValueError(
            f"the logit bias beta the model returns must be finite and the same on every rank: {per_rank(biases, repr)}"
        )


def _samples_or_unknown(batch: Any) -> float:
    """The pairs a batch holds, or NaN when its structure is wrong (a problem this rank reports)."""
    try:
        return float(samples_in(batch))
    except ValueError:
        return NOT_KNOWN


def _value(t: torch.Tensor | None) -> float:
    return float(t.detach().double().reshape(())) if t is not None else NOT_KNOWN


def _dtype_code(z: torch.Tensor) -> float:
    return float(DTYPE_CODES.index(z.dtype)) if z.dtype in DTYPE_CODES else -1.0


def _differ(values: list[float]) -> bool:
    """Two known values differ (NaN: a rank that did not know)."""
    return len({v for v in values if not math.isnan(v)}) > 1
