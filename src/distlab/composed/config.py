"""What lesson 12 trains, and on which mesh: the model's sizes, the mesh's shape, and the rules a shape
must keep, checked before any process group exists.

A shape is four degrees, written as the flags are, dp x pp x tp x cp; their product is P. It is the one
type of a run's shape, `distlab.cost.dims.ParallelDims` (lesson 13, the cost model and the planner price
the same object): its layout on the mesh (`LAYOUT`, torchtitan's: pipeline outermost, tensor parallelism
innermost), each rank's coordinates and each sub-mesh's members are written there once.

What each degree must divide (each broken rule names its flag):

    dp   the N sequences of a step; and N / dp into the M micro-batches (`--micro-batches`)
    pp   the L layers into stages; and M >= pp (torch's 1F1B schedule needs every stage busy)
    tp   the h heads, d_ff, the vocabulary V (embedding and head rows), and the seq / cp positions of a
         cp rank (sequence parallelism cuts them)
    cp   seq into 2 cp pieces (the zig-zag split of lesson 09)
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from distlab.cost.dims import DIMS, LAYOUT, ParallelDims  # noqa: F401 (DIMS, LAYOUT: lesson 12's names)

# One type for a run's shape, shared with lesson 13, the cost model and the planner (torchtitan's ParallelDims)
Shape = ParallelDims


def small_shapes(world_size: int) -> list[Shape]:
    """Every shape of P = world_size whose degrees are 1 or 2 (P = 2: each dimension alone; 4: in pairs)."""
    options = [Shape(*(2 if (i >> j) & 1 else 1 for j in range(4))) for i in range(16)]
    return [s for s in options if s.size == world_size]


def folded(shape: Shape) -> Shape:
    """Another shape of the same P: the pipeline's degree folded into dp (2 x 2 x 2 x 1 -> 4 x 1 x 2 x 1), else
    tp's, else cp's; a pure dp shape becomes a pipeline."""
    dp, pp, tp, cp = shape.dp, shape.pp, shape.tp, shape.cp
    for degree, rest in ((pp, (1, tp, cp)), (tp, (pp, 1, cp)), (cp, (pp, tp, 1))):
        if degree > 1:
            return Shape(dp * degree, *rest)
    return Shape(1, dp, tp, cp)


@dataclass(frozen=True)
class ModelConfig:
    """A small decoder-only transformer and its data: V tokens, width d, h heads, MLP width d_ff, L
    blocks; N sequences of seq tokens a step, in M micro-batches; AdamW at lr for `steps` steps."""

    vocab: int = 32
    dim: int = 32
    heads: int = 4
    ffn: int = 64
    layers: int = 4
    seq: int = 16
    batch: int = 8
    micro_batches: int = 2
    steps: int = 3
    lr: float = 1e-2
    seed: int = 0
    dtype: torch.dtype = torch.float64

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads


def check_shape(cfg: ModelConfig, shape: Shape, world_size: int, flag: str | None = None) -> None:
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
    rows = cfg.batch // shape.dp
    need(cfg.batch % shape.dp == 0, "dp", f"N = {cfg.batch} sequences do not split over dp = {shape.dp}")
    need(
        rows % cfg.micro_batches == 0,
        "micro-batches",
        f"N / dp = {rows} sequences per data-parallel rank do not split into M = {cfg.micro_batches} micro-batches",
    )
    need(cfg.layers % shape.pp == 0, "pp", f"L = {cfg.layers} layers do not split into pp = {shape.pp} stages")
    need(
        cfg.micro_batches >= shape.pp,
        "micro-batches",
        f"M = {cfg.micro_batches} micro-batches, fewer than pp = {shape.pp} stages (1F1B needs M >= pp)",
    )
    for what, count in (("h = heads", cfg.heads), ("d_ff", cfg.ffn), ("V = vocabulary", cfg.vocab)):
        need(count % shape.tp == 0, "tp", f"{what} {count} does not split over tp = {shape.tp}")
    need(cfg.seq % (2 * shape.cp) == 0, "cp", f"seq = {cfg.seq} does not cut into 2 cp = {2 * shape.cp} zig-zag pieces")
    local = cfg.seq // shape.cp
    need(
        local % shape.tp == 0,
        "tp",
        f"seq / cp = {local} positions per cp rank do not split over tp = {shape.tp} (sequence parallelism)",
    )


def check_model(cfg: ModelConfig) -> None:
    """The model's own rules, whatever the mesh: h divides d."""
    if cfg.dim % cfg.heads:
        raise ValueError(f"--dim: d = {cfg.dim} is not a multiple of h = {cfg.heads} heads")


def describe(cfg: ModelConfig) -> str:
    names = {"vocab": "V", "dim": "d", "heads": "h", "ffn": "d_ff", "layers": "L", "batch": "N", "micro_batches": "M"}
    shown = [f for f in fields(cfg) if f.name in names or f.name == "seq"]
    return ", ".join(f"{names.get(f.name, f.name)} = {getattr(cfg, f.name)}" for f in shown)
