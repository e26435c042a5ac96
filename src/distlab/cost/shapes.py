"""What the cost model is asked about: a model given by its sizes, a step's batch, a precision, and how the
step is split over the ranks. Plain data, checked once: a configuration that cannot run is refused in one
line that names the field (`distlab.cost.rules.check`), before any formula is evaluated.

The models are the lessons' own, described by sizes alone (no tensor is built):

- `Transformer`: `layers` pre-LayerNorm blocks (`distlab.proof.models.Block`: q, k, v, out projections, an MLP
  of width d_ff, two norms), with the options the lessons' blocks take (torch's fused attention, which
  saves a log-sum-exp per head and row, or attention written out, which saves the h x seq x seq weights;
  one fused qkv product or three) and, for the planner's published models, the Llama options (grouped-query
  attention, a gated SwiGLU MLP, no biases, RMSNorm) and a vocabulary (an embedding, a final norm and an
  untied output head). `vocab = 0` is a plain block stack, the lessons' model.
- `Mlp`: `distlab.proof.models.layered_mlp(widths)`, the model of lessons 01-07.

A parameter tensor is a `Weight`: its name, its rows and columns (a vector has one column), and how tensor
parallelism cuts it (lesson 08): "column" (rows split: q, k, v, fc1 and their biases), "row" (columns split:
out, fc2; their biases stay whole, added after g), or "whole" (norms; the embedding and head are cut by
vocabulary rows, "column").

The split is a `Parallel`: dp data-parallel ranks with a ZeRO stage (`distlab.data_split.sharding.accounting.STAGES`;
FSDP2 is ZeRO-3, lesson 07), tp tensor-parallel ranks with or without sequence parallelism (lesson 08), pp
pipeline ranks running a named schedule of `distlab.pipeline.schedules` with v stages per rank (lessons
02-05), cp context-parallel ranks on a zig-zag ring (lesson 09), and activation recomputation per block.
P = dp tp pp cp. With `cut_gathered`, sequence parallelism keeps the all-gathered inputs of q, k, v and fc1 as
this rank's part and gathers them again in backward (Megatron-LM's choice, which lesson 08 names; the
lesson's own keeps them whole). Expert parallelism (lesson 10) takes its ep ranks from dp: the routed experts
live E / ep to a rank and their states shard over dp / ep ranks. A split's degrees are one
`distlab.cost.dims.ParallelDims` (`Parallel.dims`), the type lesson 12's mesh and the planner's `--layout` use;
`Parallel.on(dims, **strategy)` makes a split of a shape.

The planner's models add what practitioners write: tied embeddings (GPT-2), multi-head latent attention
(DeepSeek-V2/V3: q and k/v from low-rank latents, a rotary part per head), and a mixture of experts (routed
experts, top-k, shared experts, the first blocks dense). Their weights are `Weight`s like any other (a routed
expert's stand for `experts` copies); what no lesson measures of them (their activations) is the planner's
estimate, said so where it is priced (`distlab.cost.memory`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache

from distlab.cost.dims import ParallelDims
from distlab.pipeline.partition import stage_bounds
from distlab.pipeline.schedules import make_schedule

ATTENTION = ("sdpa", "written")
ORDER = ("tp", "cp", "pp", "dp")  # mesh dimensions, innermost (fastest links) first, as Llama 3 orders them


@dataclass(frozen=True)
class Weight:
    name: str
    rows: int
    cols: int = 1  # 1: a vector
    split: str = "whole"  # how tensor parallelism cuts it: "column" (rows), "row" (columns), "whole"
    experts: int = 0  # > 0: one such matrix for each of this many routed experts (a mixture of experts)

    @property
    def numel(self) -> int:
        return self.rows * self.cols * max(1, self.experts)

    def on_rank(self, tp: int, ep: int = 1) -> int:
        """Elements one of tp tensor-parallel (and, for routed experts, one of ep expert-parallel) ranks holds."""
        if self.split == "column":
            one = self.rows // tp * self.cols
        else:
            one = self.rows * (self.cols // tp) if self.split == "row" else self.rows * self.cols
        return one * max(1, self.experts) // ep if self.experts else one

    def per_token(self, tp: int, top_k: int) -> int:
        """Elements of this matrix one token multiplies by on a rank: a routed expert's top_k of them."""
        return self.on_rank(tp) // self.experts * top_k if self.experts else self.on_rank(tp)


@dataclass(frozen=True)
class Transformer:
    """A stack of `layers` blocks of width d (`dim`), h heads, MLP width d_ff (`ffn`); with vocab > 0 an
    embedding before it and a final norm and an untied head after it."""

    layers: int
    dim: int
    heads: int
    ffn: int
    vocab: int = 0
    attention: str = "sdpa"  # "sdpa": torch's fused kernel; "written": softmax(q k^T / sqrt(d_h)) v by hand
    fused_qkv: bool = False  # q, k, v from one Linear(d, 3d): one weight tensor, not three
    kv_heads: int = 0  # 0: as many as heads; fewer: grouped-query attention (Llama)
    gated: bool = False  # SwiGLU: silu(x W_g) * (x W_1) W_2, three d x d_ff matrices (Llama)
    bias: bool = True  # every Linear has a bias (the lessons'; Llama has none)
    rms_norm: bool = False  # RMSNorm, a gain only (Llama); else LayerNorm, gain and bias
    tied: bool = False  # the head multiplies by the embedding's matrix (GPT-2): one matrix, not two
    head_size: int = 0  # d_h of q, k, v; 0: d / h (DeepSeek-V3's MLA: 128 at d = 7,168, h = 128)
    # multi-head latent attention (DeepSeek-V2/V3): q from a q_rank latent, k and v from a kv_rank latent,
    # and rope_dim more dimensions per head of q and k that carry the rotary position (k's shared by the heads)
    q_rank: int = 0  # 0: q straight from x
    kv_rank: int = 0  # > 0: multi-head latent attention
    rope_dim: int = 0
    # a mixture of experts (lesson 10): in every block after the first `dense_layers`, the MLP is `experts`
    # routed gated experts of width `expert_ffn`, each token to `top_k` of them, beside `shared_experts`
    # always-on experts of the same width
    experts: int = 0
    top_k: int = 0
    expert_ffn: int = 0
    shared_experts: int = 0
    dense_layers: int = 0

    @property
    def head_dim(self) -> int:
        return self.head_size or self.dim // self.heads

    @property
    def qk_dim(self) -> int:
        """Per head, the width q k^T sums over: d_h, and MLA's rotary part."""
        return self.head_dim + self.rope_dim

    @property
    def mla(self) -> bool:
        return self.kv_rank > 0

    def is_moe(self, layer: int) -> bool:
        return self.experts > 0 and layer >= self.dense_layers

    @property
    def kv_dim(self) -> int:
        return (self.kv_heads or self.heads) * self.head_dim

    def _linear(self, name: str, fan_out: int, fan_in: int, split: str) -> list[Weight]:
        bias_split = "column" if split == "column" else "whole"
        return [Weight(f"{name}.weight", fan_out, fan_in, split)] + (
            [Weight(f"{name}.bias", fan_out, 1, bias_split)] if self.bias else []
        )

    def _norm(self, name: str, width: int = 0) -> list[Weight]:
        width = width or self.dim
        return [Weight(f"{name}.weight", width)] + ([] if self.rms_norm else [Weight(f"{name}.bias", width)])

    def block_weights(self, moe: bool = False) -> list[Weight]:
        """One block's parameter tensors, in `named_parameters` order (`moe`: a block whose MLP is experts)."""
        d, kv, h = self.dim, self.kv_dim, self.heads
        if self.mla:
            qk, q_in = h * self.qk_dim, self.q_rank or d
            q = (
                self._linear("attn.q_down", self.q_rank, d, "whole") + self._norm("attn.q_norm", self.q_rank)
                if self.q_rank
                else []
            )
            attention = q + self._linear("attn.q", qk, q_in, "column")
            attention += self._linear("attn.kv_down", self.kv_rank + self.rope_dim, d, "whole")
            attention += self._norm("attn.kv_norm", self.kv_rank)
            attention += self._linear("attn.kv_up", h * 2 * self.head_dim, self.kv_rank, "column")
        elif self.fused_qkv:
            attention = self._linear("attn.qkv", h * self.head_dim + 2 * kv, d, "column")
        else:
            attention = [
                w
                for name, rows in (("q", h * self.head_dim), ("k", kv), ("v", kv))
                for w in self._linear(f"attn.{name}", rows, d, "column")
            ]
        attention += self._linear("attn.out", d, h * self.head_dim, "row")
        mlp = self._experts() if moe else self._mlp("mlp", self.ffn)
        return self._norm("ln1") + attention + self._norm("ln2") + mlp

    def _mlp(self, name: str, width: int, experts: int = 0) -> list[Weight]:
        def linear(part: str, fan_out: int, fan_in: int, split: str) -> list[Weight]:
            return [
                Weight(w.name, w.rows, w.cols, w.split, experts) for w in self._linear(part, fan_out, fan_in, split)
            ]

        out = linear(f"{name}.fc1", width, self.dim, "column")
        if self.gated:
            out += linear(f"{name}.gate", width, self.dim, "column")
        return out + linear(f"{name}.fc2", self.dim, width, "row")

    def _experts(self) -> list[Weight]:
        """A mixture-of-experts MLP: the router, the shared experts (as one MLP of their summed width, the
        same products), the routed experts."""
        shared = self._mlp("mlp.shared", self.shared_experts * self.expert_ffn) if self.shared_experts else []
        router = [Weight("mlp.router.weight", self.experts, self.dim)]
        return router + shared + self._mlp("mlp.experts", self.expert_ffn, self.experts)

    def layer_weights(self, layer: int) -> list[Weight]:
        return self.block_weights(self.is_moe(layer))

    def units(self) -> list[list[Weight]]:
        """The model's layers as ZeRO's flat units (lesson 07: one unit per child of the model): the
        embedding, each block, the final norm with the head."""
        blocks = [self.layer_weights(i) for i in range(self.layers)]
        if not self.vocab:
            return blocks
        return [[Weight("embedding.weight", self.vocab, self.dim, "column")], *blocks, self.head_weights()]

    def head_weights(self) -> list[Weight]:
        """The final norm and the head (vocab > 0); a tied head is the embedding's matrix, held there."""
        return self._norm("norm") + ([] if self.tied else [self.head_matrix()])

    def head_matrix(self) -> Weight:
        """The head's vocab x d product, tied or not (what its FLOPs count)."""
        return Weight("head.weight", self.vocab, self.dim, "column")

    @property
    def active_parameters(self) -> int:
        """Parameters one token's forward multiplies by or looks up: a routed expert's top_k of them."""
        return sum(w.numel // max(1, w.experts) * (self.top_k if w.experts else 1) for u in self.units() for w in u)

    @property
    def parameters(self) -> int:
        return sum(w.numel for unit in self.units() for w in unit)


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
    """How a step is split: P = dp tp pp cp ranks (see the module docstring)."""

    dp: int = 1
    zero: str = "DDP"  # one of distlab.data_split.sharding.accounting.STAGES; FSDP2 is ZeRO-3
    tp: int = 1
    sp: bool = False  # sequence parallelism beside tensor parallelism
    cut_gathered: bool = False  # sp as Megatron-LM: q, k, v's and fc1's gathered input kept cut, gathered again
    pp: int = 1
    schedule: str = "1f1b"  # a name in distlab.pipeline.schedules.SCHEDULES
    stages_per_rank: int = 1  # v
    cp: int = 1
    ep: int = 1  # expert-parallel ranks, taken from dp (`distlab.cost.dims`)
    recompute: bool = False  # torch.utils.checkpoint around every block
    selective: bool = False  # recompute only the MLP's activation function (GELU, SwiGLU's product): see memory
    grad_bytes: int = 0  # bytes of a gradient element under mixed precision (0: the precision's e; Megatron: 4)

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def dims(self) -> ParallelDims:
        """The run's shape, the one type lesson 12, lesson 13 and the planner share."""
        return ParallelDims(self.dp, self.pp, self.tp, self.cp, self.ep)

    @classmethod
    def on(cls, dims: ParallelDims, **strategy) -> Parallel:
        """A split of shape `dims` with the strategy `strategy` (zero, sp, schedule, recompute, ...)."""
        return cls(dp=dims.dp, tp=dims.tp, pp=dims.pp, cp=dims.cp, ep=dims.ep, **strategy)

    def label(self) -> str:
        """A short name: dp4 ZeRO-1 tp2+sp pp2 (1f1b, M) cp2, the sizes that are not 1."""
        parts = [f"dp{self.dp} {self.zero}" if self.dp > 1 else ""]
        sp = ("+sp" + ("(cut)" if self.cut_gathered else "")) if self.sp else ""
        parts += [f"tp{self.tp}{sp}" if self.tp > 1 else ""]
        v = f" v{self.stages_per_rank}" if self.stages_per_rank > 1 else ""
        parts += [f"pp{self.pp} {self.schedule}{v}" if self.pp > 1 else "", f"cp{self.cp}" if self.cp > 1 else ""]
        parts += [f"ep{self.ep}" if self.ep > 1 else ""]
        parts += ["recompute" if self.recompute else "selective recompute" if self.selective else ""]
        return " ".join(p for p in parts if p) or "one rank"


@cache
def schedule_of(name: str, pp: int, micro_batches: int, stages_per_rank: int):
    """`distlab.pipeline.schedules.make_schedule`, made once per (name, pp, M, v): a planner asks thousands
    of configurations for the same few schedules. Callers read it, never change it."""
    return make_schedule(name, pp, micro_batches, stages_per_rank)


def stage_layers(model: Transformer | Mlp, parallel: Parallel) -> list[range]:
    """The layers of each of the pp v stages (`distlab.pipeline.partition.stage_bounds`: as even as can be,
    the first stages one layer longer)."""
    return _bounds(model.layers, parallel.pp * parallel.stages_per_rank)


@cache
def _bounds(layers: int, stages: int) -> list[range]:
    return stage_bounds(layers, stages)


def ceil_div(a: int, b: int) -> int:
    return math.ceil(a / b)
