"""What lesson 12 trains, and on which mesh: the model's sizes, the mesh's shape, and the rules a shape
must keep, checked before any process group exists.

A shape is four degrees, written as the flags are, dp x pp x tp x cp; their product is P. It is the one
type of a run's shape, `distlab.composed.dims.ParallelDims` (lesson 13, the cost model and the planner price
the same object): its layout on the mesh (`LAYOUT`, torchtitan's: pipeline outermost, tensor parallelism
innermost), each rank's coordinates and each sub-mesh's members are written there once.

What each degree must divide is the shape's one validation, `ParallelDims.check` (the cost model and the
planner ask the same): dp the N sequences and N / dp into the M micro-batches (`--micro-batches`); tp the h
heads, d_ff, the vocabulary V and the seq / cp positions of a cp rank (the lesson always runs sequence
parallelism); cp seq into 2 cp zig-zag pieces. The lesson adds two rules of its own, each for a reason of
its mesh: pp divides L (`keep_stage` gives every stage L / pp blocks) and M >= pp (torch's Schedule1F1B
needs every stage busy); and `check_model` asks seq to cut into 2 pieces at cp = 1 too (the zig-zag layout
places every rank's positions, cp = 1 included). Each broken rule names its flag.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from distlab.composed.dims import ParallelDims
from distlab.proof.sizes import Transformer


def small_shapes(world_size: int) -> list[ParallelDims]:
    """Every shape of P = world_size whose degrees are 1 or 2 (P = 2: each dimension alone; 4: in pairs)."""
    options = [ParallelDims(*(2 if (i >> j) & 1 else 1 for j in range(4))) for i in range(16)]
    return [s for s in options if s.size == world_size]


def folded(shape: ParallelDims) -> ParallelDims:
    """Another shape of the same P: the pipeline's degree folded into dp (2 x 2 x 2 x 1 -> 4 x 1 x 2 x 1), else
    tp's, else cp's; a pure dp shape becomes a pipeline."""
    dp, pp, tp, cp = shape.dp, shape.pp, shape.tp, shape.cp
    for degree, rest in ((pp, (1, tp, cp)), (tp, (pp, 1, cp)), (cp, (pp, tp, 1))):
        if degree > 1:
            return ParallelDims(dp * degree, *rest)
    return ParallelDims(1, dp, tp, cp)


# The lesson's model: V = 32 tokens, d = 32, h = 4, d_ff = 64, L = 4 blocks, k without its bias (`model.py`)
MODEL = Transformer(layers=4, dim=32, heads=4, ffn=64, vocab=32, key_bias=False)


@dataclass(frozen=True)
class RunConfig:
    """What lesson 12 trains, on what: the model's sizes (`model`, the library's one size record: V tokens,
    width d, h heads, MLP width d_ff, L blocks); N sequences of seq tokens a step, in M micro-batches; AdamW
    at lr for `steps` steps."""

    model: Transformer = MODEL
    seq: int = 16
    batch: int = 8
    micro_batches: int = 2
    steps: int = 3
    lr: float = 1e-2
    seed: int = 0
    dtype: torch.dtype = torch.float64


def check_shape(cfg: RunConfig, shape: ParallelDims, world_size: int, flag: str | None = None) -> None:
    """Every rule of the module docstring, in order; the first one broken raises one ValueError naming its
    flag, the same on every rank, before any process group exists. A shape given by the four flags names
    the degree's own (--pp: ...); one from a list names the list's flag and the shape (--shapes: 2x2x2x1: ...)."""

    listed = "" if flag is None else f"{shape}: "

    def need(ok: bool, dim: str, message: str) -> None:
        if not ok:
            named = f"--{dim}" if flag is None or dim == "micro-batches" else flag
            raise ValueError(f"{named}: {listed}{message}")

    if shape.size != world_size:
        named = flag or "--dp, --pp, --tp, --cp"
        raise ValueError(f"{named}: {listed}dp x pp x tp x cp = {shape.size} ranks, but P = {world_size}")
    try:
        shape.check(cfg.model, cfg.batch, cfg.seq, cfg.micro_batches, sequence_parallel=True)
    except ValueError as err:
        blamed, _, message = str(err).partition(": ")
        need(False, blamed.replace("_", "-"), message)
    layers = cfg.model.layers
    need(layers % shape.pp == 0, "pp", f"L = {layers} layers do not split into pp = {shape.pp} stages")
    need(
        cfg.micro_batches >= shape.pp,
        "micro-batches",
        f"M = {cfg.micro_batches} micro-batches, fewer than pp = {shape.pp} stages (1F1B needs M >= pp)",
    )


def check_model(cfg: RunConfig) -> None:
    """The run's own rules, whatever the mesh: h divides d; seq cuts into the zig-zag layout's 2 pieces."""
    if cfg.model.dim % cfg.model.heads:
        raise ValueError(f"--dim: d = {cfg.model.dim} is not a multiple of h = {cfg.model.heads} heads")
    if cfg.seq % 2:
        raise ValueError(f"--seq-len: seq = {cfg.seq} does not cut into the zig-zag layout's 2 pieces")


def describe(cfg: RunConfig) -> str:
    """V = 32, d = 32, h = 4, d_ff = 64, L = 4, seq = 16, N = 8, M = 2: the sizes in the README's notation."""
    m = cfg.model
    sizes = (("V", m.vocab), ("d", m.dim), ("h", m.heads), ("d_ff", m.ffn), ("L", m.layers), ("seq", cfg.seq))
    sizes += (("N", cfg.batch), ("M", cfg.micro_batches))
    return ", ".join(f"{name} = {value}" for name, value in sizes)
