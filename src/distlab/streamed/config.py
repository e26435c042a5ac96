"""The streamed step's config: the dict a caller passes, read into the names the math uses.

Keys: GLOBAL_BATCH_SIZE (N), MICRO_BATCH_SIZE (B), TAU (tau; leave it out when the model returns its own
logit scale s), and the optional STREAM_CHUNK_SIZE (T, the side of the torch tiles; left out: from the
device and a memory budget, `chunk_size`); NORMALISERS, how phase 2 computes the log-normalisers a, b:
"sharded" (default; each rank its own C rows and columns of S, then a tiny all-gather) or "replicated"
(every rank all N^2 similarities, no exchange); EXCHANGE, how the ranks' embeddings meet: "gather"
(default; every rank holds N x 2d) or "ring" (C x d blocks pass rank to rank, `distlab.streamed.ring_passes`);
KERNELS, who does the tile work: "auto" (default: the Triton kernels with W in memory, "triton-mm", on CUDA
tensors at a tensor-core MATMUL_PRECISION, the torch tiles elsewhere), "torch", "triton", "triton-mm" or
"triton-s" (S in memory: cuBLAS S, one Triton pass; `kernel_choice`); MATMUL_PRECISION, how the tiles
multiply: "float32" (default), "tf32" or "bf16" (`precision`); W_MEMORY_MIB, for "triton-mm" the most MiB of the
coefficient tile W alive at once, for "triton-s" of S (left out: 512 on a GPU, 4,096 rows of bf16 W at
N = 65,536; `kernels.coefficients`).
A misspelt key is reported with the closest known name rather than silently ignored. `parse_config` is pure:
given the same dict it raises the same ValueError on every rank.
"""

from __future__ import annotations

import difflib
import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from distlab.pieces.chunks import balanced_chunks

REQUIRED = ("GLOBAL_BATCH_SIZE", "MICRO_BATCH_SIZE")
OPTIONAL = ("STREAM_CHUNK_SIZE", "TAU", "NORMALISERS", "EXCHANGE", "KERNELS", "MATMUL_PRECISION", "W_MEMORY_MIB")
KERNELS = ("auto", "torch", "triton", "triton-mm", "triton-s")  # `kernel_choice`
MATMUL_PRECISIONS = ("float32", "tf32", "bf16")  # `precision`
NORMALISERS = ("sharded", "replicated")
EXCHANGES = ("gather", "ring")
DEFAULT_NORMALISERS = "sharded"  # measured faster for P >= 2 (benchmarks/contrastive_scaling.py)


@dataclass(frozen=True)
class StreamConfig:
    """The validated config, with the names the math uses."""

    n: int  # N, the global batch
    b: int  # B, the largest micro-batch
    t: int | None  # T, the stream chunk (tiles are at most T x T); None: from the device (`chunk_size`)
    tau: float | None  # None: the model returns the logit scale s
    normalisers: str  # "sharded" or "replicated"
    world: int  # P, the size of the group the wrapper reduces over
    rank: int  # this rank's place in that group
    group: Any = field(default=None, compare=False)  # that process group (None: the world)
    exchange: str = "gather"  # "gather" or "ring"
    kernels: str = "auto"  # who does the tile work: "auto", "torch", "triton", "triton-mm", "triton-s"
    precision: str = "float32"  # MATMUL_PRECISION: "float32", "tf32" or "bf16" (`precision`)
    w_mib: int | None = None  # W_MEMORY_MIB: "triton-mm"'s budget for W (None: the default, `kernels.coefficients`)

    @property
    def w_budget(self) -> int | None:
        """W_MEMORY_MIB in bytes (None: left out)."""
        return None if self.w_mib is None else self.w_mib * 2**20

    @property
    def local(self) -> int:
        """C = N / P, this rank's share of the global batch."""
        return self.n // self.world

    @property
    def offset(self) -> int:
        """Where this rank's rows sit in the global batch (rank-major, like the gather)."""
        return self.rank * self.local

    @property
    def one_forward(self) -> bool:
        """B >= C: the rank's pairs are one micro-batch, so phase 1's forward keeps its graph and
        phase 4 back-propagates into it (no recompute). B < C: phase 1 runs without grad, phase 4
        recomputes each micro-batch under the random state phase 1 saved."""
        return self.b >= self.local

    @property
    def micro(self) -> list[slice]:
        """This rank's micro-batches (local rows): the fewest of at most B rows, sizes within one."""
        return balanced_chunks(self.local, min(self.b, self.local))


def regime(cfg: StreamConfig) -> str:
    """Which regime a config lands in, and what it costs per rank, in a sentence."""
    if cfg.one_forward:
        return (
            f"one forward (B = {cfg.b} >= C = {cfg.local}): each pair runs through the encoders once, "
            "with grad; phase 4 back-propagates G into that graph (no recompute, no RNG replay); "
            f"the activations of all {cfg.local} pairs are held from phase 1 to 4, as plain DDP holds them"
        )
    sizes = sorted({part.stop - part.start for part in cfg.micro})
    return (
        f"recompute (B = {cfg.b} < C = {cfg.local}): {len(cfg.micro)} micro-batches of "
        f"{' or '.join(map(str, sizes))} pairs; phase 1 runs each without grad, phase 4 again with grad "
        "under the same random state: 2 forwards per pair, the activations of one micro-batch at a time"
    )


def _int_key(config: Mapping[str, Any], key: str) -> int:
    value = config[key]
    # bool is an int in Python; True as a batch size is a bug, not a 1.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"config[{key!r}] must be an int, got {value!r} ({type(value).__name__})")
    if value < 1:
        raise ValueError(f"config[{key!r}] must be >= 1, got {value}")
    return int(value)


def _tau(config: Mapping[str, Any]) -> float | None:
    if "TAU" not in config:
        return None
    tau = config["TAU"]
    if isinstance(tau, bool) or not isinstance(tau, numbers.Real):
        hint = " (for a learned scale leave TAU out of the config)" if tau is None else ""
        raise ValueError(f"config['TAU'] must be a number, got {tau!r} ({type(tau).__name__}){hint}")
    if not (tau > 0 and math.isfinite(tau)):  # also rejects NaN
        raise ValueError(f"config['TAU'] (temperature) must be a finite number > 0, got {tau}")
    return float(tau)


def parse_config(config: Mapping[str, Any], world: int, rank: int, group: Any = None) -> StreamConfig:
    """Check the keys and their values; pure, so it is the same on every rank. `world` and `rank` are
    the size of `group` (the process group the wrapper reduces over; None: the world) and this
    rank's place in it: N is the batch of that group."""
    if not isinstance(config, Mapping):
        raise ValueError(f"config must be a dict, got {type(config).__name__}")
    known = REQUIRED + OPTIONAL
    unknown = [k for k in config if k not in known]
    if unknown:
        hints = []
        for key in unknown:
            close = difflib.get_close_matches(str(key), known, n=1)
            hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise ValueError(f"unknown config key(s) {', '.join(hints)}; known keys: {known}")
    missing = [k for k in REQUIRED if k not in config]
    if missing:
        raise ValueError(
            f"config is missing {missing}; it needs {list(REQUIRED)}, and TAU unless the model returns its logit scale"
        )
    n, b = (_int_key(config, k) for k in REQUIRED)
    t = _int_key(config, "STREAM_CHUNK_SIZE") if "STREAM_CHUNK_SIZE" in config else None
    normalisers = config.get("NORMALISERS", DEFAULT_NORMALISERS)
    if normalisers not in NORMALISERS:
        raise ValueError(f"config['NORMALISERS'] must be one of {NORMALISERS}, got {normalisers!r}")
    exchange = config.get("EXCHANGE", "gather")
    if exchange not in EXCHANGES:
        raise ValueError(f"config['EXCHANGE'] must be one of {EXCHANGES}, got {exchange!r}")
    kernels = config.get("KERNELS", "auto")
    if kernels not in KERNELS:
        raise ValueError(f"config['KERNELS'] must be one of {KERNELS}, got {kernels!r}")
    precision = config.get("MATMUL_PRECISION", "float32")
    if precision not in MATMUL_PRECISIONS:
        raise ValueError(f"config['MATMUL_PRECISION'] must be one of {MATMUL_PRECISIONS}, got {precision!r}")
    w_mib = _int_key(config, "W_MEMORY_MIB") if "W_MEMORY_MIB" in config else None
    if n % world:
        raise ValueError(
            f"GLOBAL_BATCH_SIZE N={n} is not divisible by the world size P={world}: every rank must hold N / P pairs"
        )
    return StreamConfig(n, b, t, _tau(config), normalisers, world, rank, group, exchange, kernels, precision, w_mib)
