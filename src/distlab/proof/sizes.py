"""A transformer described by its sizes alone: the one size record of the library. Lesson 08's block
(`distlab.layer_split.tensor_parallel.model.BlockConfig` holds one of a single layer), lesson 12's language
model (`distlab.composed.config.RunConfig`), lesson 13's cost model and the planner's published models are
each a `Transformer`; no tensor is built from it here (`distlab.proof.models.Block` builds the block).

`Transformer`: `layers` pre-LayerNorm blocks (`distlab.proof.models.Block`: q, k, v, out projections, an MLP
of width d_ff, two norms), with the options the lessons' blocks take (torch's fused attention, which saves a
log-sum-exp per head and row, or attention written out, which saves the h x seq x seq weights; one fused qkv
product or three; lesson 12's k projection without its bias) and, for the planner's published models, the
Llama options (grouped-query attention, a gated SwiGLU MLP, no biases, RMSNorm) and a vocabulary (an
embedding, a final norm and an untied output head). `vocab = 0` is a plain block stack, lesson 08's model.
The planner's models add what practitioners write: tied embeddings (GPT-2), multi-head latent attention
(DeepSeek-V2/V3: q and k/v from low-rank latents, a rotary part per head), and a mixture of experts (routed
experts, top-k, shared experts, the first blocks dense).

A parameter tensor is a `Weight`: its name (as `named_parameters` gives it), its rows and columns (a vector
has one column), and which of its dimensions tensor parallelism cuts (lesson 08): "column" (rows split: q, k,
v, fc1 and their biases), "row" (columns split: out, fc2; their biases stay whole, added after the
all-reduce), or "whole" (norms; the embedding and head are cut by vocabulary rows, "column"). A routed
expert's weight stands for `experts` copies.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

ATTENTION = ("sdpa", "written")  # torch's fused kernel; softmax(q k^T / sqrt(d_h)) v written out


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

    def piece(self, tp: int) -> tuple[int, int]:
        """(rows, cols) of the piece one of tp tensor-parallel ranks holds of one such matrix."""
        if self.split == "column":
            return self.rows // tp, self.cols
        return (self.rows, self.cols // tp) if self.split == "row" else (self.rows, self.cols)

    def on_rank(self, tp: int, ep: int = 1) -> int:
        """Elements one of tp tensor-parallel (and, for routed experts, one of ep expert-parallel) ranks holds."""
        rows, cols = self.piece(tp)
        return rows * cols * max(1, self.experts) // ep if self.experts else rows * cols

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
    key_bias: bool = True  # k's bias, when there are biases (lesson 12 drops it: its gradient is exactly zero)
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
        bias = self.bias and (self.key_bias or name != "attn.k")
        return [Weight(f"{name}.weight", fan_out, fan_in, split)] + (
            [Weight(f"{name}.bias", fan_out, 1, bias_split)] if bias else []
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

    def one_block(self) -> Transformer:
        """One of its blocks alone (one layer, no vocabulary): the sizes lesson 08's formulas take."""
        return replace(self, layers=1, vocab=0, tied=False)

    def layer_weights(self, layer: int) -> list[Weight]:
        return self.block_weights(self.is_moe(layer))

    def units(self) -> list[list[Weight]]:
        """The model's layers as ZeRO's flat units (lesson 07: one unit per child of the model): the
        embedding, each block, the final norm with the head."""
        blocks = [self.layer_weights(i) for i in range(self.layers)]
        if not self.vocab:
            return blocks
        return [[self.embedding()], *blocks, self.head_weights()]

    def embedding(self) -> Weight:
        """The V x d token embedding (vocab > 0), cut by vocabulary rows under tensor parallelism."""
        return Weight("embed.weight", self.vocab, self.dim, "column")

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
