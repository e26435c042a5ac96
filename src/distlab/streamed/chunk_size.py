"""T when the config leaves STREAM_CHUNK_SIZE out, and a warning when a T would launch too many kernels.

The torch tiles make each tile of S in memory and run about a dozen ops on it, so the tile's side T sets two
costs per rank and step: memory, about ALIVE tiles of min(T, C) x T floats alive at once, and launches, about
K ops per tile times the tiles a step walks (4 passes over C x N for the gathered InfoNCE: ceil(C/T) ceil(N/T)
tiles each; see `torch_launches`). A GPU spends ~5 us of host time on each launch, so at N = 65,536, P = 8
the README's T = 1,024 launched 17,600 kernels a step, and T = 128 1.2 million: seconds of launching alone.

The default: rows up to C, columns from a memory budget. With b the budget in floats over ALIVE, T = b / C
when a C x C tile fits (T >= C: one block of all C rows, columns in chunks of T), else T = sqrt(b) (square
tiles); a multiple of 64, at least 64, at most N. The budget: 1/32 of the GPU's memory, at most 2 GiB (an
80 GB H100: 2 GiB, so at C = 8,192 in float32 T = 21,824: 3 column chunks, about 1,300 launches a step);
8 MiB on a CPU (cache-sized tiles: T = 832, or all C rows when C is small). The Triton kernels (KERNELS) do
not use T: their tiles live in registers and their launches per step do not depend on N or T.
"""

from __future__ import annotations

import math
import warnings

import torch

ALIVE = 3  # tiles of S alive at once in the torch tiles: the tile, its exponentials, a temporary
CPU_BUDGET = 8 * 2**20
GPU_BUDGET_CAP = 2 * 2**30
ALIGN = 64
LAUNCH_LIMIT = 4_000  # more launches than this per step on CUDA: the one-time warning
_warned: set = set()


def budget_bytes(device: torch.device) -> int:
    """What the torch tiles may hold: 1/32 of a GPU's memory (at most 2 GiB), or 8 MiB on a CPU."""
    if device.type == "cuda":
        return min(torch.cuda.get_device_properties(device).total_memory // 32, GPU_BUDGET_CAP)
    return CPU_BUDGET


def default_chunk(c: int, n: int, budget: int, itemsize: int) -> int:
    """T for C rows against N columns within `budget` bytes (the module docstring's rule)."""
    floats = budget // (ALIVE * itemsize)
    t = floats // c if c * c <= floats else math.isqrt(floats)
    return max(1, min(n, max(ALIGN, t // ALIGN * ALIGN)))


def tiles_per_step(cfg, t: int) -> int:
    """The T x T tiles one rank's InfoNCE step walks with the torch tiles."""
    c, n = cfg.local, cfg.n
    blocks = math.ceil(c / t)
    if cfg.exchange == "ring":  # P visits of C x C in each of pass 1 and pass 2
        return 2 * cfg.world * blocks * blocks
    if cfg.normalisers == "replicated":
        return math.ceil(n / t) ** 2 + 2 * blocks * math.ceil(n / t)
    return 4 * blocks * math.ceil(n / t)


# Kernel-launching torch ops per tile of the InfoNCE's torch tiles: one rank's step counted on the meta device
# (`rank_work.count_rank`: 1,198 launches gathered, 1,079 in the ring) at the shape COUNTED_AT (rank 0 of
# P = COUNTED_WORLD), over the tiles it walks there (`tiles_per_step`: 128 and 64). A constant, so the warning
# imports nothing of the step it warns about (counting it here closed a circle of nine modules);
# tests/test_streamed_tile_ops.py counts the step again and holds the constant equal, so a change to the torch
# tiles' ops fails there until the figure here is the new count. Work per step or per block of rows rather than
# per tile is spread over this small shape's tiles, so at another shape the estimate is off by up to a tenth (one
# rank of N = 65,536, P = 8, B = C at T = 1,024: 19,168 for 17,462 counted gathered, 17,264 for 16,535 in the ring;
# at T = 4,096 1,198 for 1,178 and 1,079 for 1,157): the warning's "about".
COUNTED_AT = {"GLOBAL_BATCH_SIZE": 64, "MICRO_BATCH_SIZE": 32, "STREAM_CHUNK_SIZE": 8, "TAU": 0.1, "KERNELS": "torch"}
COUNTED_WORLD = 2
LAUNCHES_PER_TILE = {"gather": 1198 / 128, "ring": 1079 / 64}


def torch_launches(cfg, t: int) -> int:
    """About how many kernels the torch tiles launch in one rank's step at this T."""
    return round(tiles_per_step(cfg, t) * LAUNCHES_PER_TILE[cfg.exchange])


def chunk_for(cfg, device: torch.device, dtype: torch.dtype) -> int:
    """T for this step: the default for the device (the config left STREAM_CHUNK_SIZE out)."""
    return default_chunk(cfg.local, cfg.n, budget_bytes(device), torch.finfo(dtype).bits // 8)


def warn_if_many_launches(cfg, t: int, device: torch.device, dtype: torch.dtype) -> None:
    """Once per (N, P, T, exchange): on CUDA, a torch-tile step of more than LAUNCH_LIMIT launches is named,
    with the default T and what it launches."""
    if device.type != "cuda" or (key := (cfg.n, cfg.world, t, cfg.exchange)) in _warned:
        return
    launches = torch_launches(cfg, t)
    if launches > LAUNCH_LIMIT:
        _warned.add(key)
        better = chunk_for(cfg, device, dtype)
        warnings.warn(
            f"STREAM_CHUNK_SIZE T = {t} launches about {launches:,} kernels per step on this rank (N = {cfg.n}, "
            f"P = {cfg.world}): seconds of host time on a GPU. T = {better} launches about "
            f"{torch_launches(cfg, better):,} (leave STREAM_CHUNK_SIZE out for it), and KERNELS 'triton' a "
            "few dozen whatever T is",
            stacklevel=3,
        )
