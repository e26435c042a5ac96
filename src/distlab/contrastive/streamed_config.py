"""Checking the streamed step's inputs before any collective, the same way on every rank.

A collective that only some ranks reach waits for the others until the process group's timeout. So
`validate_step` raises a ValueError *before* the first collective, and only from information that
every rank holds identically (the config, the world size, the model's type and attributes) or that
every rank can hold up against the same yardstick: its own batch against N / P. A rank whose local
batch is not N / P raises; if every rank's batch is off (the usual bug: a wrong GLOBAL_BATCH_SIZE, or
a sampler that is not a DistributedSampler), every rank raises the same error. If only some ranks'
data is off, the others cannot know without a collective: they fail in the first all-gather (gloo:
the peer closed its connection; nccl: the process group's timeout) instead of hanging forever.

Config keys (seed 000): GLOBAL_BATCH_SIZE (N), MICRO_BATCH_SIZE (B), STREAM_CHUNK_SIZE (M), TAU, and
the optional PHASE_B, "sharded" (default) or "replicated". A misspelt key is reported with the
closest known name, rather than silently ignored.
"""

from __future__ import annotations

import difflib
import math
import numbers
from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

REQUIRED = ("GLOBAL_BATCH_SIZE", "MICRO_BATCH_SIZE", "STREAM_CHUNK_SIZE", "TAU")
PHASE_B_VARIANTS = ("sharded", "replicated")
DEFAULT_PHASE_B = "sharded"  # measured faster for P >= 2 (benchmarks/contrastive_scaling.py)
OPTIONAL = ("PHASE_B",)


@dataclass(frozen=True)
class StreamConfig:
    """The validated config, with the names the math uses."""

    n: int          # N, the global batch
    b: int          # B, the micro-batch
    m: int          # M, the stream chunk
    tau: float
    phase_b: str    # "sharded" or "replicated"
    world: int      # P
    rank: int

    @property
    def local(self) -> int:
        """C = N / P, this rank's share of the global batch."""
        return self.n // self.world

    @property
    def offset(self) -> int:
        """Where this rank's rows sit in the global batch (rank-major, like the gather)."""
        return self.rank * self.local


def _int_key(config: Mapping[str, Any], key: str) -> int:
    value = config[key]
    # bool is an int in Python; True as a batch size is a bug, not a 1.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"config[{key!r}] must be an int, got {value!r} ({type(value).__name__})")
    if value < 1:
        raise ValueError(f"config[{key!r}] must be >= 1, got {value}")
    return int(value)


def parse_config(config: Mapping[str, Any], world: int, rank: int) -> StreamConfig:
    """Check the keys and their values; pure, so it is the same on every rank."""
    if not isinstance(config, Mapping):
        raise ValueError(f"config must be a dict, got {type(config).__name__}")
    unknown = [k for k in config if k not in REQUIRED + OPTIONAL]
    if unknown:
        hints = []
        for key in unknown:
            close = difflib.get_close_matches(str(key), REQUIRED + OPTIONAL, n=1)
            hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise ValueError(f"unknown config key(s) {', '.join(hints)}; known keys: {REQUIRED + OPTIONAL}")
    missing = [k for k in REQUIRED if k not in config]
    if missing:
        raise ValueError(f"config is missing {missing}; it needs {list(REQUIRED)}")
    n, b, m = (_int_key(config, k) for k in REQUIRED[:3])
    tau = config["TAU"]
    if isinstance(tau, bool) or not isinstance(tau, numbers.Real):
        raise ValueError(f"config['TAU'] must be a number, got {tau!r} ({type(tau).__name__})")
    if not (tau > 0 and math.isfinite(tau)):  # also rejects NaN
        raise ValueError(f"config['TAU'] (temperature) must be a finite number > 0, got {tau}")
    phase_b = config.get("PHASE_B", DEFAULT_PHASE_B)
    if phase_b not in PHASE_B_VARIANTS:
        raise ValueError(f"config['PHASE_B'] must be one of {PHASE_B_VARIANTS}, got {phase_b!r}")
    if n % world:
        raise ValueError(f"GLOBAL_BATCH_SIZE N={n} is not divisible by the world size P={world}: "
                         "every rank must hold N / P pairs")
    return StreamConfig(n, b, m, float(tau), phase_b, world, rank)


def validate_step(model: Any, optimizer: Any, local_x: Any, local_y: Any,
                  config: Mapping[str, Any]) -> StreamConfig:
    """Every check of `distributed_train_step`'s inputs; raises ValueError, runs no collective."""
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("distributed_train_step needs an initialised process group: launch with "
                         "torchrun and call torch.distributed.init_process_group first")
    cfg = parse_config(config, dist.get_world_size(), dist.get_rank())
    if not isinstance(model, DistributedDataParallel):
        raise ValueError(f"model must be wrapped in DistributedDataParallel, got {type(model).__name__}: "
                         "its gradient all-reduce is the step's second sync point")
    lacking = [name for name in ("encoder_x", "encoder_y") if not hasattr(model.module, name)]
    if lacking:
        raise ValueError(f"model.module ({type(model.module).__name__}) lacks {lacking}: the model "
                         "contract needs encoder_x and encoder_y attributes and forward(x, y) -> (z_x, z_y)")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    for name, t in (("local_x", local_x), ("local_y", local_y)):
        if not isinstance(t, torch.Tensor) or t.dim() < 1:
            raise ValueError(f"{name} must be a tensor with a batch dimension, got {t!r:.60}")
    if local_x.shape[0] != local_y.shape[0]:
        raise ValueError(f"local_x and local_y must hold the same number of pairs, got "
                         f"{local_x.shape[0]} and {local_y.shape[0]}")
    if local_x.shape[0] != cfg.local:
        raise ValueError(f"this rank holds {local_x.shape[0]} pairs, but GLOBAL_BATCH_SIZE N={cfg.n} over "
                         f"P={cfg.world} ranks means N / P = {cfg.local} each (is N right, and does every "
                         "rank get an equal share, e.g. a DistributedSampler with drop_last=True?)")
    return cfg


def check_embeddings(out: Any, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """forward(x, y) must return (z_x, z_y), both `rows` x d. Checked on the first micro-batch, before
    the gather; every rank runs the same model on same-shaped inputs, so every rank agrees."""
    if not (isinstance(out, (tuple, list)) and len(out) == 2
            and all(isinstance(z, torch.Tensor) for z in out)):
        raise ValueError(f"model(x, y) must return a pair of tensors (z_x, z_y), got {type(out).__name__}")
    z_x, z_y = out
    if z_x.dim() != 2 or z_x.shape != z_y.shape or z_x.shape[0] != rows:
        raise ValueError(f"model(x, y) must return z_x and z_y of one shape (batch x d) with batch {rows}, "
                         f"got {tuple(z_x.shape)} and {tuple(z_y.shape)}")
    if not z_x.is_floating_point() or z_x.dtype != z_y.dtype:
        raise ValueError(f"embeddings must share one floating dtype, got {z_x.dtype} and {z_y.dtype}")
    return z_x, z_y
