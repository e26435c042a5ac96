"""Launch configurations chosen by measurement: a table from the cards on record, a short timed search on the
first use of anything else, and its winner cached on disk. On CUDA only: on a CPU nothing is searched, read or
written, and the defaults of `launch` / `coefficients` / `lse` are taken.

What a launch configuration is worth depends on the card, on d (how long each S tile's dot product is, how many
registers the epilogue leaves) and on the dtype; one sweep on one card at one d (the defaults) is a guess
elsewhere. So a configuration is looked up by its key,

    device name | d | dtype | precision | kind        kind: "fold", "ring-fold", "infonce-mm", "sigmoid-mm",
                                                            "infonce", "sigmoid"

(the row fold, the ring's fold with column statistics, the InfoNCE's and the sigmoid's coefficient GEMM, and
their fused products, W in registers), in this order:

    1. WINNERS, the table committed from the GPU runs on record (no search: a user's first step is not one);
    2. this process's memory of earlier answers;
    3. the cache file, `cache_path()`: $DISTLAB_KERNEL_CACHE, else <user cache dir>/distlab/kernel_tiles.json;
    4. a search: each of a few candidates (tiles, warps, stages, rows of W) run on the call's own operands,
       timed (`cuda_timer`: the median of 3 after a warm-up that compiles), the fastest kept, then written to the
       cache file atomically (a temporary file in the same folder, then `os.replace`: a reader sees the old file
       or the new one, never half of one; ranks of one machine writing at once may lose one another's entry,
       which is searched again on its next first use). A candidate that fails to compile or to launch is skipped.

Ranks of one step may time differently and choose differently; each rank's result stays exact (every
candidate is the same arithmetic, summed in another order), only bit-identity across ranks' configurations is
not promised. `choice_for` says, for a key, which configuration would be taken and why.
"""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from distlab.streamed.kernels import path_model
from distlab.streamed.kernels.launch import Blocks

ENV = "DISTLAB_KERNEL_CACHE"
LOG = logging.getLogger(__name__)
H200, H100 = "NVIDIA H200", "NVIDIA H100 80GB HBM3"  # torch.cuda.get_device_name of the cards on record


def _b(m, n, d, stages=3, warps=8):
    """Blocks(m, n, d, warps, stages), stages first: the records vary them more than the warps (8 in every winner)."""
    return Blocks(m, n, d, warps, stages)


# The winners on record, bf16 embeddings at MATMUL_PRECISION "bf16", one rank of N = 65,536 (P = 8):
# - H200, d = 1,024 (benchmarks/results/gpu/2026-11-28-decide-h200: sweep/ and ring_parts/): the ring's fold
#   128 x 128 x 64 (0.0010 s a visit against 0.0013 s in 128 x 256); the InfoNCE GEMM 128 x 256 x 64, 3 stages
#   (0.0160 s a step against 0.0173 s in 128 x 128); the sigmoid GEMM 128 x 128 x 64, 4 stages (0.0105 s, the
#   one configuration timed; 0.0107 s at 3 stages in decide/); the row fold 128 x 256 x 64 (the one timed).
# - H200, d = 512, 256, 128 (ring_parts/): the whole InfoNCE ring timed with one block set for its fold and its
#   GEMM: 128 x 256 x 64 at 4 stages (0.0136 s), 128 x 128 x 64 (0.0086 s), 128 x 256 x 64 at 4 stages
#   (0.0101 s), against the defaults' 0.0141, 0.0109 and 0.0111 s; so both kinds take that set.
# - the fused products (KERNELS "triton"), d = 1,024: on the H200 (sweep/) the InfoNCE's 128 x 256 x 64 in 10
#   column ranges (0.0293 s against 0.0333 s in the ranges the SM count gave then), the sigmoid's 128 x 256 x 64
#   (0.0385 s against 0.0407 s in 128 x 128); on the H100 (2026-11-26-kernels-h100/sweep, the only kernels timed
#   there: "triton-mm" was not yet built) the InfoNCE's 128 x 256 x 64 (0.0350 s), the sigmoid's 128 x 128 x 64
#   (0.0456 s).
SMALL_D = {128: _b(128, 256, 64, 4)}
WINNERS: dict[tuple[str, str], dict[int, Blocks]] = {
    (H200, "ring-fold"): {1024: _b(128, 128, 64), 512: _b(128, 256, 64, 4), 256: _b(128, 128, 64)} | SMALL_D,
    (H200, "infonce-mm"): {1024: _b(128, 256, 64), 512: _b(128, 256, 64, 4), 256: _b(128, 128, 64)} | SMALL_D,
    (H200, "sigmoid-mm"): {1024: _b(128, 128, 64, 4)},
    (H200, "fold"): {1024: _b(128, 256, 64)},
    (H200, "infonce"): {1024: replace(_b(128, 256, 64), splits=10)},
    (H200, "sigmoid"): {1024: _b(128, 256, 64)},
    (H100, "infonce"): {1024: _b(128, 256, 64)},
    (H100, "sigmoid"): {1024: _b(128, 128, 64)},
}
# Which KERNELS "auto" takes on CUDA at a tensor-core precision, per card and d: on the H200 W in memory won at
# every d timed (ring_parts/: 128 to 1,024, both losses, both exchanges, and at tf32).
PATHS: dict[str, dict[int, str]] = {H200: {1024: "triton-mm", 512: "triton-mm", 256: "triton-mm", 128: "triton-mm"}}
UNMEASURED_PATH = "triton-mm"  # a card or d not on record: the H200's winner at every d it timed
# S in memory (KERNELS "triton-s") against W in memory, timed in one run on one card: card -> d -> rows of
# (loss, exchange, seconds with S in memory, seconds with W in memory), one rank of N = 65,536, P = 8 at bf16.
# Empty until a GPU run times it (benchmarks/gpu_next.py's group S): "auto" takes "triton-s" on a card only at
# a d whose every row on record is faster with S in memory (`s_in_memory_measured`), never by the model alone.
S_IN_MEMORY_MEASURED: dict[str, dict[int, list[tuple[str, str, float, float]]]] = {}


@dataclass(frozen=True)
class Choice:
    """A configuration and where it came from: "table", "memory", "cache", "search" or "default"."""

    blocks: Blocks
    source: str
    why: str


def cache_path() -> Path:
    """$DISTLAB_KERNEL_CACHE, else the user's cache folder ($XDG_CACHE_HOME or ~/.cache)/distlab/kernel_tiles.json."""
    if os.environ.get(ENV):
        return Path(os.environ[ENV])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "distlab" / "kernel_tiles.json"


def key(device_name: str, d: int, dtype: torch.dtype, precision: str, kind: str) -> str:
    return f"{device_name}|d={d}|{str(dtype).removeprefix('torch.')}|{precision}|{kind}"


def read_cache(path: Path) -> dict:
    """The cache file's entries; an absent or unreadable file is an empty cache (it is only a shortcut)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def write_cache(path: Path, name: str, blocks: Blocks) -> None:
    """Add one entry, atomically: the whole file rewritten into a temporary file beside it, then renamed over it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    entries = read_cache(path) | {name: asdict(blocks)}
    handle, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(handle, "w") as f:
            json.dump(entries, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def cuda_timer(call: Callable[[], object]) -> float:
    """Seconds of one call on the current CUDA stream: a warm-up (which compiles), then the median of 3."""
    call()
    times = []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def candidates(kind: str, default: Blocks) -> list[Blocks]:
    """What a search tries: the default, the tiles the records found competitive, and for the GEMMs W in
    chunks of 2,048 and 4,096 rows besides the budget's (`coefficients.chunk_rows` never exceeds the budget)."""
    tiles = [default, _b(128, 128, 64), _b(128, 256, 64), _b(128, 128, 64, 4), _b(128, 256, 64, 4)]
    tiles = list(dict.fromkeys(tiles + [_b(64, 128, 64, 3, 4)]))
    if kind.endswith("-mm"):
        tiles += [replace(default, w_rows=rows) for rows in (2048, 4096)]
    return tiles


def search(trials: list[Blocks], run: Callable[[Blocks], object], timer: Callable) -> tuple[Blocks, list]:
    """The fastest of `trials` by `timer(lambda: run(blocks))`, and every trial's (blocks, seconds or error)."""
    timed = []
    for blocks in trials:
        try:
            timed.append((blocks, timer(lambda blocks=blocks: run(blocks))))
        except Exception as err:  # noqa: BLE001 - a configuration this card cannot compile or launch is skipped
            timed.append((blocks, f"{type(err).__name__}: {err}"[:200]))
    scored = [(seconds, i) for i, (_, seconds) in enumerate(timed) if isinstance(seconds, float)]
    if not scored:
        raise RuntimeError(f"no launch configuration ran: {timed}")
    return timed[min(scored)[1]][0], timed


_MEMORY: dict[str, Choice] = {}


def nearest(by_d: dict[int, object], d: int):
    """The entry at d, else at the measured d nearest in ratio (None when there is none)."""
    if not by_d:
        return None
    return by_d[min(by_d, key=lambda known: abs(math.log(known / d)))]


def choose_on(name: str, kind: str, default: Blocks, run: Callable[[Blocks], object], timer: Callable, path: Path):
    """Steps 1-4 of the module docstring for one key `name` (device | d | dtype | precision | kind)."""
    device_name, d_field, _, precision, _ = name.split("|")
    if precision == "bf16" and (found := nearest(WINNERS.get((device_name, kind), {}), int(d_field[2:]))):
        return Choice(found, "table", f"{device_name}'s measured winner at the d on record nearest {d_field}")
    if name in _MEMORY:
        return _MEMORY[name]
    if (entry := read_cache(path).get(name)) is not None:
        _MEMORY[name] = Choice(Blocks(**entry), "cache", f"measured earlier on this machine ({path})")
        return _MEMORY[name]
    best, timed = search(candidates(kind, default), run, timer)
    write_cache(path, name, best)
    why = f"searched {len(timed)} configurations on first use, cached in {path}"
    _MEMORY[name] = Choice(best, "search", why)
    LOG.info("distlab kernels %s: %s (%s)", name, best, why)
    return _MEMORY[name]


def choose(kind: str, q: torch.Tensor, precision: str, default: Blocks, run: Callable[[Blocks], object]) -> Choice:
    """The configuration for a launch on q's device: on CUDA `choose_on` (table, memory, cache, search); on any
    other device the default, and no file is read or written."""
    if q.device.type != "cuda":
        return Choice(default, "default", f"{q.device.type}: no search and no cache off CUDA")
    name = key(torch.cuda.get_device_name(q.device), q.shape[1], q.dtype, precision, kind)
    return choose_on(name, kind, default, run, cuda_timer, cache_path())


def auto_kernels(device: torch.device, d: int | None, dtype: torch.dtype, precision: str) -> tuple[str, str]:
    """What KERNELS "auto" takes, and why in a sentence: the torch tiles off CUDA, for float64 and at IEEE
    float32; on CUDA at tf32 / bf16 the winner on record for this card and d (`measured_path`: "triton-s" only
    where S_IN_MEMORY_MEASURED says it was faster), else "triton-mm"; the sentence ends with the three paths'
    modelled floors (`path_model`), so the log says what the model expected beside what was measured."""
    if device.type != "cuda":
        return "torch", f"{device.type} tensors: the torch tiles (the kernels need CUDA)"
    if dtype == torch.float64 or precision == "float32":
        what = "float64 embeddings" if dtype == torch.float64 else "MATMUL_PRECISION 'float32'"
        return "torch", f"{what}: the torch tiles on cuBLAS (faster than the kernels' FMA products on record)"
    name = torch.cuda.get_device_name(device) if torch.cuda.is_available() else "no CUDA device here"
    path, why = measured_path(name, d)
    return path, f"{why}; {modelled(name, d or 1024, precision)}"


def measured_path(name: str, d: int | None) -> tuple[str, str]:
    """The path the GPU records say is fastest on card `name` at the d on record nearest d: "triton-s" where
    `s_in_memory_measured` says so, else the PATHS table's winner, else UNMEASURED_PATH; and why."""
    faster, evidence = s_in_memory_measured(name, d or 1024)
    if faster:
        return "triton-s", f"{name}: S in memory measured faster than W in memory ({evidence})"
    measured = nearest(PATHS.get(name, {}), d or 1024)
    if measured is not None:
        return measured, f"{name}'s measured winner at d nearest {d} (benchmarks/results/gpu/); {evidence}"
    return UNMEASURED_PATH, f"{name} not on record: {UNMEASURED_PATH!r}, the H200's winner at every d from 128 to 1,024"


def s_in_memory_measured(name: str, d: int) -> tuple[bool, str]:
    """Whether S_IN_MEMORY_MEASURED's rows for this card at the d on record nearest d are all faster with S in
    memory than with W in memory, and the evidence in words (no rows: not faster, "S in memory not yet timed")."""
    rows = nearest(S_IN_MEMORY_MEASURED.get(name, {}), d)
    if not rows:
        return False, f"S in memory not yet timed on {name}"
    said = ", ".join(
        f"{loss} {exchange} {s_time:.4f} s against {w_time:.4f} s" for loss, exchange, s_time, w_time in rows
    )
    return all(s_time < w_time for _, _, s_time, w_time in rows), said


def modelled(name: str, d: int, precision: str) -> str:
    """The model's floors of the three paths for one rank of the InfoNCE ring at N = 65,536, P = 8, d, in words
    (`path_model`; a card without measured rates has none)."""
    rates = path_model.rates_for(name)
    if rates is None or precision != "bf16":
        return f"no modelled floor ({name} at {precision}: no rates on record)"
    shape = path_model.Shape("infonce", "ring", 65536, 8, d)
    floors = ", ".join(f"{path} {seconds:.4f} s" for path, seconds in path_model.floors(shape, rates).items())
    return f"modelled floors, InfoNCE ring at N = 65,536, P = 8: {floors} ({rates.source})"


_SAID: set[str] = set()


def say_once(line: str) -> None:
    """Log `line` (logger distlab.streamed.kernels.tuning, INFO) the first time it is said in this process."""
    if line not in _SAID:
        _SAID.add(line)
        LOG.info(line)
