"""Checking the streamed step's inputs so that every rank raises the same error, and none hangs.

A collective that only some ranks reach waits for the others until the process group's timeout (or,
on gloo, fails with "Connection closed by peer" once the rank that raised has exited). A forward can
be such a collective: DDP's forward with grad broadcasts the module's buffers (BatchNorm's running
statistics, open_clip's attention mask) and, once, rebuilds its buckets; FSDP2's all-gathers the
parameters. So the step checks in three stages, and none lets a rank leave early:

1. `check_locally`: the config, the wrapper, the model contract, frozen towers, BatchNorm. A rank
   that finds a problem does not raise yet: it records it.
2. `agree_before_forward`, before Phase A's forward: one all-gather of a few numbers per rank (N, B,
   TAU or the learnable mode, PHASE_B, the rank's pair counts, "I found a problem"). A config that
   differs across ranks (a silently wrong gradient, or ranks in different regimes whose forwards
   communicate differently), a rank whose batch is not N / P, or any rank's local problem: every
   rank raises here, before any rank's forward runs.
3. `agree_across_ranks`, after the forward and before the first all-gather: the embedding widths
   and dtypes, the logit scale s (finite, positive, the same on every rank), and whether the
   forward raised or returned something outside the contract on some rank (that rank still joins).

Every rank raises the same message: when some ranks found a problem, their messages are exchanged
(only then) and each rank raises all of them, naming the ranks. A ValueError for bad input; a
RuntimeError when model(x, y) itself raised on some rank (on that rank chained to the original).

Limits. A rank without a process group raises at once (there is no one to tell). Under FSDP2 a
forward that raises on one rank can leave the others inside FSDP2's own all-gathers; under DDP the
module's forward does not communicate once DDP's pre-forward work is done.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.distributed as dist

from distlab.contrastive.streamed_config import PHASE_B_VARIANTS, StreamConfig, parse_config
from distlab.contrastive.streamed_wrappers import Wrapped, batchnorm_in_training, trainable, unwrap

DTYPE_CODES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
BEFORE = ("problem", "N", "B", "TAU", "PHASE_B", "rows_x", "rows_y")
AFTER = ("problem", "raised", "d_x", "d_y", "dtype_x", "dtype_y", "scale")
NOT_KNOWN = float("nan")
LEARNABLE = 0.0  # the TAU field of a rank whose model returns its own logit scale
KEY_NAMES = {"N": "GLOBAL_BATCH_SIZE N", "B": "MICRO_BATCH_SIZE B"}  # as the caller typed them


@dataclass
class LocalCheck:
    """What stage 1 found on this rank: what the step needs, or the problem (then the rest is None)."""

    cfg: StreamConfig | None = None
    wrapped: Wrapped | None = None
    factor: float = 1.0                       # what the wrapper divides the summed gradient by
    problem: str | None = None


def check_locally(model: Any, local_x: Any, local_y: Any, config: Mapping[str, Any]) -> LocalCheck:
    """Stage 1; raises only when there is no process group to join (and so no one to hang)."""
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("the streamed step needs an initialised process group: launch with torchrun "
                         "and call torch.distributed.init_process_group first")
    try:
        if not torch.is_grad_enabled():
            raise ValueError("the streamed step was called with gradients disabled (inside torch.no_grad()?): "
                             "it computes a gradient")
        cfg = parse_config(config, dist.get_world_size(), dist.get_rank())
        wrapped = unwrap(model)
        lacking = [name for name in ("encoder_x", "encoder_y") if not hasattr(wrapped.inner, name)]
        if lacking:
            raise ValueError(f"{type(wrapped.inner).__name__} lacks {lacking}: the model contract needs "
                             "encoder_x and encoder_y attributes and forward(x, y) -> (z_x, z_y[, s])")
        for name, t in (("local_x", local_x), ("local_y", local_y)):
            if not isinstance(t, torch.Tensor) or t.dim() < 1:
                raise ValueError(f"{name} must be a tensor with a batch dimension, got {t!r:.60}")
        if local_x.shape[0] != local_y.shape[0]:
            raise ValueError(f"local_x and local_y must hold the same number of pairs, got "
                             f"{local_x.shape[0]} and {local_y.shape[0]}")
        if not (trainable(wrapped.inner.encoder_x) or trainable(wrapped.inner.encoder_y)):
            raise ValueError("both towers are frozen (no parameter of encoder_x or encoder_y requires "
                             "grad): there is nothing for the step to train")
        bn = batchnorm_in_training(wrapped.inner)
        if bn and not cfg.one_forward:
            raise ValueError(
                f"BatchNorm in training mode ({', '.join(bn[:3])}) with MICRO_BATCH_SIZE B={cfg.b} < "
                f"C=N/P={cfg.local}: each micro-batch would be normalised over its own B rows instead "
                "of the rank's C, and the running statistics updated twice per micro-batch (the "
                "no-grad pass and the recompute). Use B >= C (one forward, exactly plain DDP), put "
                "BatchNorm in eval mode, or use a normalisation that does not mix samples "
                "(LayerNorm, GroupNorm)")
        if wrapped.static_graph and not cfg.one_forward:
            raise ValueError(f"DDP(static_graph=True) with MICRO_BATCH_SIZE B={cfg.b} < C=N/P={cfg.local}: the "
                             "recompute runs every micro-batch's backward but the last under no_sync(), which "
                             "a static-graph DDP does not support. Use B >= C (one forward) or DDP without "
                             "static_graph")
        factor = wrapped.reduction_factor
    except ValueError as err:
        return LocalCheck(problem=str(err))
    return LocalCheck(cfg, wrapped, factor)


def _describe(out: Any) -> str:
    """What forward returned, in a few words (open_clip's output_dict=True gives a dict, and a model
    with a logit bias, SigLIP's, a fourth element)."""
    if isinstance(out, dict):
        return f"a dict with keys {list(out)[:4]} (return a tuple, e.g. open_clip's output_dict=False)"
    if isinstance(out, (tuple, list)):
        return f"a {type(out).__name__} of {len(out)}: ({', '.join(type(z).__name__ for z in out[:4])})"
    return type(out).__name__


def check_outputs(out: Any, rows: int, cfg: StreamConfig) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """forward(x, y) must return (z_x, z_y) or (z_x, z_y, s): z of `rows` x d, floating point, one
    width; s a one-element tensor, and then config must not hold TAU. Returns (z_x, z_y, s or None)."""
    if not (isinstance(out, (tuple, list)) and len(out) in (2, 3)
            and all(isinstance(z, torch.Tensor) for z in out)):
        raise ValueError(f"model(x, y) must return (z_x, z_y) or (z_x, z_y, logit_scale) as tensors, "
                         f"got {_describe(out)}")
    z_x, z_y, s = (*out, None) if len(out) == 2 else out
    if z_x.dim() != 2 or z_y.dim() != 2 or z_x.shape[1] != z_y.shape[1] or len(z_x) != rows or len(z_y) != rows:
        raise ValueError(f"model(x, y) must return z_x and z_y of shape (batch, d) with batch {rows} and "
                         f"one d, got {tuple(z_x.shape)} and {tuple(z_y.shape)}")
    if not (z_x.is_floating_point() and z_y.is_floating_point()):
        raise ValueError(f"embeddings must be floating point, got {z_x.dtype} and {z_y.dtype}")
    if s is not None and (s.numel() != 1 or not s.is_floating_point()):
        raise ValueError(f"the logit scale model(x, y) returns third must be a one-element floating "
                         f"tensor, got shape {tuple(s.shape)} {s.dtype}")
    if s is not None and cfg.tau is not None:
        raise ValueError(f"config holds TAU={cfg.tau}, but the model returns its own logit scale: "
                         "leave TAU out of the config (the logits are s * z_x z_y^T with the model's s)")
    if s is None and cfg.tau is None:
        raise ValueError("config has no TAU and the model returns no logit scale: pass TAU, or return "
                         "(z_x, z_y, logit_scale) from forward")
    return z_x, z_y, s


def _table(row: list[float], device: torch.device) -> torch.Tensor:
    """Every rank's row (rank-major), on the group's device, read back on the CPU."""
    mine = torch.tensor(row, dtype=torch.float64, device=device)
    table = mine.new_empty(dist.get_world_size() * len(row))
    dist.all_gather_single(table, mine)
    return table.view(dist.get_world_size(), len(row)).cpu()


def _column(table: torch.Tensor, fields: tuple, key: str) -> list[float]:
    return table[:, fields.index(key)].tolist()


def _differ(values: list[float]) -> bool:
    known = {v for v in values if not math.isnan(v)}
    return len(known) > 1


def _per_rank(values: list[float], fmt=lambda v: f"{v:g}") -> str:
    return ", ".join(f"rank {r}: {'?' if math.isnan(v) else fmt(v)}" for r, v in enumerate(values))


def _raise_problems(problem: str | None, lengths: list[float], device: torch.device,
                    error: type = ValueError, cause: BaseException | None = None) -> None:
    """If any rank found a problem (its message's length in `lengths`), exchange the messages (every
    rank takes part) and raise one text naming the ranks, the same on every rank."""
    if not any(lengths):
        return
    width = int(max(lengths))
    mine = torch.zeros(width, dtype=torch.uint8)
    if problem:
        data = problem.encode()
        mine[:len(data)] = torch.tensor(list(data), dtype=torch.uint8)
    mine = mine.to(device)
    every = mine.new_empty(dist.get_world_size() * width)
    dist.all_gather_single(every, mine)
    every = every.view(-1, width).cpu()
    texts = [bytes(every[r, :int(n)].tolist()).decode() for r, n in enumerate(lengths)]
    by_text: dict[str, list[int]] = {}
    for r, text in enumerate(texts):
        if text:
            by_text.setdefault(text, []).append(r)
    if len(by_text) == 1 and len(next(iter(by_text.values()))) == len(texts):
        message = next(iter(by_text))  # every rank found the same problem: no need to name ranks
    else:
        message = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {text}"
                            for text, rs in by_text.items())
        message += " (every rank stops here, before the first all-gather)"
    raise error(message) from cause


def _length(problem: str | None) -> float:
    return float(len(problem.encode())) if problem else 0.0


def agree_before_forward(check: LocalCheck, local_x: Any, local_y: Any, device: torch.device) -> None:
    """Stage 2: config, pair counts and local problems, before any rank's forward; raises the same
    error on every rank, or returns."""
    row = dict.fromkeys(BEFORE, NOT_KNOWN)
    row["problem"] = _length(check.problem)
    if check.cfg is not None:
        cfg = check.cfg
        row.update(N=cfg.n, B=cfg.b, TAU=LEARNABLE if cfg.tau is None else cfg.tau,
                   PHASE_B=PHASE_B_VARIANTS.index(cfg.phase_b))
    for key, t in (("rows_x", local_x), ("rows_y", local_y)):
        if isinstance(t, torch.Tensor) and t.dim() >= 1:
            row[key] = t.shape[0]
    table = _table([float(row[k]) for k in BEFORE], device)
    names = {"TAU": lambda v: "learnable scale" if v == LEARNABLE else f"{v:g}",
             "PHASE_B": lambda v: PHASE_B_VARIANTS[int(v)]}
    for key in ("N", "B", "TAU", "PHASE_B"):
        if _differ(_column(table, BEFORE, key)):
            raise ValueError(f"config differs across ranks, {KEY_NAMES.get(key, key)}: "
                             f"{_per_rank(_column(table, BEFORE, key), names.get(key, lambda v: f'{v:g}'))}; "
                             "every rank must pass the same config")
    _raise_problems(check.problem, _column(table, BEFORE, "problem"), device)
    rows = _column(table, BEFORE, "rows_x")
    if any(r != check.cfg.local for r in rows):
        raise ValueError(f"every rank must hold N / P = {check.cfg.n} / {check.cfg.world} = {check.cfg.local} "
                         f"pairs, but {_per_rank(rows)} (is N right, and does every rank get an equal share, "
                         "e.g. a DistributedSampler with drop_last=True?)")


def agree_across_ranks(failure: BaseException | None, by_model: bool, out: tuple | None,
                       cfg: StreamConfig, device: torch.device) -> None:
    """Stage 3, after the forward and before the first all-gather. `failure`: what this rank's
    forward raised (`by_model`) or `check_outputs` raised, else None; `out`: the first micro-batch's
    checked outputs, else None."""
    row = dict.fromkeys(AFTER, NOT_KNOWN)
    problem = None
    if failure is not None:
        problem = f"model(x, y) raised {type(failure).__name__}: {failure}" if by_model else str(failure)
        row.update(raised=float(by_model))
    row["problem"] = _length(problem)
    if out is not None:
        z_x, z_y, s = out
        row.update(d_x=z_x.shape[1], d_y=z_y.shape[1], dtype_x=DTYPE_CODES.index(z_x.dtype)
                   if z_x.dtype in DTYPE_CODES else -1, dtype_y=DTYPE_CODES.index(z_y.dtype)
                   if z_y.dtype in DTYPE_CODES else -1)
        row["scale"] = float(s.detach().double().reshape(())) if s is not None else NOT_KNOWN
    table = _table([float(row[k]) for k in AFTER], device)
    raised = any(v == 1.0 for v in _column(table, AFTER, "raised"))
    _raise_problems(problem, _column(table, AFTER, "problem"), device,
                    RuntimeError if raised else ValueError, failure)
    for key in ("d_x", "d_y", "dtype_x", "dtype_y"):
        values = _column(table, AFTER, key)
        if _differ(values):
            fmt = (lambda v: str(DTYPE_CODES[int(v)]) if v >= 0 else "other") if "dtype" in key else None
            raise ValueError(f"the embeddings differ across ranks, {key}: "
                             f"{_per_rank(values, fmt) if fmt else _per_rank(values)}")
    if cfg.tau is None:
        scales = _column(table, AFTER, "scale")
        if not all(math.isfinite(v) and v > 0 for v in scales):
            raise ValueError(f"the logit scale s the model returns must be finite and > 0 on every rank: "
                             f"{_per_rank(scales, repr)}")
        if len(set(scales)) > 1:
            raise ValueError(f"the logit scale s differs across ranks ({_per_rank(scales, repr)}): the "
                             "replicas are out of sync")
