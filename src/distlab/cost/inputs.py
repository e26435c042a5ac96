"""What the cost model is asked about: a model given by its sizes, a step's batch, a precision, and how the
step is split over the ranks. Plain data, checked once: a configuration that cannot run is refused in one
line that names the field (`distlab.cost.rules.check`), before any formula is evaluated.

The models are the lessons' own, described by sizes alone (no tensor is built):

- `distlab.proof.sizes.Transformer`, the library's one transformer size record (lesson 08's block, lesson
  12's model, the planner's published models), and its `Weight`s: each parameter tensor with the dimension
  tensor parallelism cuts;
- `Mlp`: `distlab.proof.models.layered_mlp(widths)`, the model of lessons 01-07.

The split is a `Parallel`: dp data-parallel ranks with a ZeRO stage (`distlab.data_split.sharding.accounting.STAGES`;
FSDP2 is ZeRO-3, lesson 07), tp tensor-parallel ranks with or without sequence parallelism (lesson 08), pp
pipeline ranks running a named schedule of `distlab.model_split.schedules` with v stages per rank (lessons
02-05), cp context-parallel ranks on a zig-zag ring (lesson 09), and activation recomputation per block.
P = dp tp pp cp. With `cut_gathered`, sequence parallelism keeps the all-gathered inputs of q, k, v and fc1 as
this rank's part and gathers them again in backward (Megatron-LM's choice, which lesson 08 names; the
lesson's own keeps them whole). Expert parallelism (lesson 10) takes its ep ranks from dp: the routed experts
live E / ep to a rank and their states shard over dp / ep ranks. A split holds its degrees as one
`distlab.composed.dims.ParallelDims` (`Parallel.dims`), the type lesson 12's mesh and the planner's `--layout` use:
`Parallel(dims, **strategy)`.

What no lesson measures of the planner's models (the activations of multi-head latent attention and of
a mixture of experts) is the planner's estimate, said so where it is priced (`distlab.cost.memory`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache

from distlab.composed.dims import ParallelDims
from distlab.model_split.partition import stage_bounds
from distlab.model_split.schedules import make_schedule
from distlab.proof.sizes import Transformer, Weight


@dataclass(frozen=True)
class Mlp:
    """`distlab.proof.models.layered_mlp(widths)`: layer i maps widths[i] -> widths[i + 1], one unit each."""

    widths: tuple[int, ...]

    @property
    def layers(self) -> int:
        return len(self.widths) - 1

    def units(self) -> list[list[Weight]]:
        pairs = zip(self.widths[:-1], self.widths[1:])
        return [[Weight(f"{i}.weight", o, n), Weight(f"{i}.bias", o)] for i, (n, o) in enumerate(pairs)]

    @property
    def parameters(self) -> int:
        return sum(w.numel for unit in self.units() for w in unit)


@dataclass(frozen=True)
class Batch:
    """N sequences (rows) of seq tokens per step, in M micro-batches on every data-parallel rank."""

    global_batch: int  # N
    seq: int = 1
    micro_batches: int = 1  # M

    @property
    def tokens(self) -> int:
        return self.global_batch * self.seq


@dataclass(frozen=True)
class Precision:
    """e bytes per element of weights, gradients and activations; mixed: bf16 ones beside a float32 master
    copy and float32 AdamW moments (lesson 07's 16 Psi bytes). `peak`: the device rate its matrix products
    run at; fp8 is bf16 training whose Linears multiply in fp8 (Transformer Engine's recipe: bf16 weights,
    float32 master and moments, fp8 copies made for the product and dropped), so its bytes are bf16's and its
    products run at the fp8 peak; MFU still divides by the bf16 peak (`mfu_peak`), as DeepSeek-V3 reports."""

    name: str
    e: int
    mixed: bool = False
    peak: str = ""  # "": the precision's own name

    @property
    def rate(self) -> str:
        return self.peak or self.name

    @property
    def mfu_peak(self) -> str:
        return "bf16" if self.name == "fp8" else self.name


PRECISIONS = {
    p.name: p
    for p in (
        Precision("float64", 8),
        Precision("float32", 4),
        Precision("bf16", 2, True),
        Precision("fp8", 2, True, "fp8"),
    )
}


@dataclass(frozen=True)
class Parallel:
    """How a step is split: a shape (`dims`, P = dp pp tp cp ranks) and the strategy run on it (see the module
    docstring). The degrees are the shape's, read through it (`parallel.tp` is `parallel.dims.tp`)."""

    dims: ParallelDims = ParallelDims()
    zero: str = "DDP"  # one of distlab.data_split.sharding.accounting.STAGES; FSDP2 is ZeRO-3
    sp: bool = False  # sequence parallelism beside tensor parallelism
    cut_gathered: bool = False  # sp as Megatron-LM: q, k, v's and fc1's gathered input kept cut, gathered again
    schedule: str = "1f1b"  # a name in distlab.model_split.schedules.SCHEDULES
    stages_per_rank: int = 1  # v
    recompute: bool = False  # torch.utils.checkpoint around every block
    selective: bool = False  # Megatron-LM's selective recomputation: attention's core (q k^T, softmax, dropout,
    # omega v) rerun in backward from the q, k, v kept (Korthikanti et al., 2022)
    act_fn: bool = False  # only the MLP's activation function (GELU, SwiGLU's product) rebuilt: see memory
    grad_bytes: int = 0  # bytes of a gradient element under mixed precision (0: the precision's e; Megatron: 4)
    measures: tuple[str, ...] = ()  # names of MEASURES taken (DeepSeek-V3's memory measures; `distlab.cost.memory`)

    dp = property(lambda self: self.dims.dp)
    pp = property(lambda self: self.dims.pp)
    tp = property(lambda self: self.dims.tp)
    cp = property(lambda self: self.dims.cp)
    ep = property(lambda self: self.dims.ep)  # expert-parallel ranks, taken from dp (`distlab.composed.dims`)

    @property
    def world(self) -> int:
        return self.dims.size

    def label(self) -> str:
        """A short name: dp4 ZeRO-1 tp2+sp pp2 (1f1b, M) cp2, the sizes that are not 1."""
        parts = [f"dp{self.dp} {self.zero}" if self.dp > 1 else ""]
        sp = ("+sp" + ("(cut)" if self.cut_gathered else "")) if self.sp else ""
        parts += [f"tp{self.tp}{sp}" if self.tp > 1 else ""]
        v = f" v{self.stages_per_rank}" if self.stages_per_rank > 1 else ""
        parts += [f"pp{self.pp} {self.schedule}{v}" if self.pp > 1 else "", f"cp{self.cp}" if self.cp > 1 else ""]
        parts += [f"ep{self.ep}" if self.ep > 1 else ""]
        rebuilt = "recompute" if self.recompute else "selective recompute" if self.selective else ""
        parts += [rebuilt or ("act-fn recompute" if self.act_fn else "")]
        parts += [f"+{m}" for m in self.measures]
        return " ".join(p for p in parts if p) or "one rank"


# DeepSeek-V3's memory measures (technical report, https://arxiv.org/abs/2412.19437, sections 3.2.3 and 3.3.3), each
# a choice of its own; their formulas are `distlab.cost.memory.measure_savings` and `distlab.cost.memory.model_states`
MEASURES = {
    "recompute-norm-up": "every RMSNorm's output and MLA's up-projections (q, k, v) rebuilt in backward, not kept",
    "fp8-activations": "Linear inputs kept in FP8 (E5M6 after attention), the MoE SwiGLU's inputs in FP8, its output "
    "rebuilt",
    "bf16-moments": "AdamW's two moments in bf16, not float32",
}
DEEPSEEK_V3_MEASURES = tuple(MEASURES)  # all three, as DeepSeek-V3 trained (its master weights and gradients float32)


@cache
def schedule_of(name: str, pp: int, micro_batches: int, stages_per_rank: int):
    """`distlab.model_split.schedules.make_schedule`, made once per (name, pp, M, v): a planner asks thousands
    of configurations for the same few schedules. Callers read it, never change it."""
    return make_schedule(name, pp, micro_batches, stages_per_rank)


def stage_layers(model: Transformer | Mlp, parallel: Parallel) -> list[range]:
    """The layers of each of the pp v stages (`distlab.model_split.partition.stage_bounds`: as even as can be,
    the first stages one layer longer). DualPipe's 2P stages are two copies of a P-way cut: stage k and stage
    P + k are chunk k of copy 0 and of copy 1 (`distlab.cost.schedule`)."""
    if parallel.schedule == "dualpipe":
        return _bounds(model.layers, parallel.pp) * 2
    return _bounds(model.layers, parallel.pp * parallel.stages_per_rank)


def firsts(parallel: Parallel) -> tuple[int, ...]:
    """The stages that begin a copy of the model (the embedding's): 0, and P under DualPipe (copy 1's chunk 0)."""
    return (0, parallel.pp) if parallel.schedule == "dualpipe" else (0,)


def lasts(parallel: Parallel) -> tuple[int, ...]:
    """The stages that end a copy of the model (the head's): the last, and P - 1 under DualPipe (copy 0's)."""
    last = parallel.pp * parallel.stages_per_rank - 1
    return (parallel.pp - 1, last) if parallel.schedule == "dualpipe" else (last,)


@cache
def _bounds(layers: int, stages: int) -> list[range]:
    return stage_bounds(layers, stages)


def ceil_div(a: int, b: int) -> int:
    return math.ceil(a / b)
