"""What one rank holds after a step, item by item, in bytes: every formula a lesson measured, composed.

Model states (lesson 07, `distlab.data_split.sharding.accounting.held`): the rank's parameters are those of its
pipeline stages (lesson 02), cut by tensor parallelism (lesson 08: column and row weights by tp, norms and
row biases whole), as flat units, one per layer, that ZeRO shards over dp ranks: Psi_P = sum_u ceil(Psi_u /
dp). In one precision (float64, float32) the items are lesson 07's table as it is. Mixed precision prices
the same items at two sizes: bf16 weights and gradients (the table at e = 2), a float32 master copy (the
ZeRO-1/2 shard copy at 4 bytes; a whole one under DDP, `accounting.expected_states_mixed`; ZeRO-3 keeps a float32 shard
beside its bf16 one) and float32 moments (the table at 4): 2 + 2 + 4 + 8 = 16 bytes per parameter in DDP, and
ZeRO-2 and -3 the ZeRO paper's 2 + 14 / dp and 16 / dp. ZeRO-1 is priced as Megatron-LM's distributed
optimizer (docs: "Distributed Optimizer", its table of bytes per parameter), the ZeRO-1 that large runs use:
the reduce-scatter lands in place in the one contiguous gradient buffer (no shard beside it, unlike lesson 07's
by hand), and AdamW steps float32 main gradients: with float32 gradients (`grad_bytes` 4) that is the buffer
itself, 2 + 4 + 12 / dp = Megatron's 6 + 12/d; with bf16 gradients a float32 shard of its own, 2 + 2 + 16 / dp
= Megatron's 4 + 16/d. Lesson 07's stages by hand also keep their bf16 shard as a tensor of its own, 2 / dp
more for ZeRO-1 and -2 (`accounting.held` with e_m = 4 prices that); an implementation that steps a slice of
the whole bf16 weights, as priced here, does not.

Activations per block and micro-batch, what the forward leaves alive for backward plus its output (the
input is the previous block's output, counted there), by storage as `distlab.proof.held` counts:

- attention by torch's fused kernel: lesson 08's region + gathered + inside / tp, (region + inside) / tp +
  gathered with sequence parallelism (`distlab.layer_split.tensor_parallel.cost.activation_bytes`), on seq / cp tokens
  under context parallelism (lesson 09: a rank keeps its own queries, keys and values; the blocks in flight
  are transient); with `cut_gathered` (Megatron-LM) the gathered inputs cut by tp too. Llama's options change
  three terms the lessons do not run, priced as fused kernels save them: grouped-query attention's k and v are
  T d_kv, not T d; a fused SwiGLU saves three T d_ff tensors, not two; RMSNorm one statistic per row, not two;
- attention written out: lesson 07's `accounting.block_activations` (the softmax weights, h seq^2 per row)
  less the input and the target it counts for a one-block model;
- the layered MLP: lesson 07's `accounting.mlp_activations` on a stage's widths (lessons 02-03: a stage
  saves its input and its tanh outputs; the last one the output and the target);

times the micro-batches a rank holds at once, which the schedule decides (`distlab.model_split.simulator.
peak_in_flight`: GPipe M, 1F1B min(M, P - r), lessons 02-05). With recomputation a block keeps only its
output, and one block at a time holds its whole activations again while its backward runs.

`buffers` are the planner's estimate of what lives only for a moment but must fit (no lesson measures them
exactly): ZeRO-3's gathered layers (one in use, one prefetched), the ring's k/v blocks in flight (lesson 09's
bound), and on the last stage the logits and their float32 log-softmax.
"""

from __future__ import annotations

from fractions import Fraction
from functools import cache

import torch

from distlab.cost.inputs import PRECISIONS, Batch, Mlp, Parallel, Precision, ceil_div, firsts, lasts, stage_layers
from distlab.cost.schedule import in_flight, stages
from distlab.data_split.sharding import accounting
from distlab.layer_split.context_parallel.cost import Sizes as RingSizes
from distlab.layer_split.tensor_parallel.cost import activation_bytes, activation_terms, sdpa_math_path
from distlab.layer_split.tensor_parallel.model import BlockConfig
from distlab.proof.sizes import Transformer

DTYPE_OF = {8: torch.float64, 4: torch.float32, 2: torch.bfloat16}
LN_STATISTICS = 4  # per token: LN_1's and LN_2's mean and 1/std, in lesson 08's region


@cache
def unit_sizes(model: Transformer | Mlp, tp: int, ep: int = 0) -> tuple[tuple[int, int], ...]:
    """(elements one of tp ranks holds, tensors) of each of the model's flat units: its dense weights, or
    with ep > 0 its routed experts' (one of ep expert-parallel ranks' share), which ZeRO shards over the
    dp / ep ranks that hold the same experts."""
    return tuple(
        (sum(w.on_rank(tp, ep or 1) for w in mine), len(mine))
        for mine in ([w for w in unit if bool(w.experts) == bool(ep)] for unit in model.units())
    )


def rank_units(
    model: Transformer | Mlp, parallel: Parallel, pp_rank: int, batch: Batch, experts: bool = False
) -> list[tuple[int, int]]:
    """(elements on this rank, tensors) of every flat unit of the stages pipeline rank `pp_rank` holds (with
    `experts`: of the routed experts' units instead, empty for a dense model). A tied head on a last stage
    that is not the first holds a copy of the embedding (Megatron-LM's: its gradient all-reduced with it)."""
    units, held = unit_sizes(model, parallel.tp, parallel.ep if experts else 0), stages(parallel, batch, pp_rank)
    bounds, offset = stage_layers(model, parallel), 1 if getattr(model, "vocab", 0) else 0
    first, last = any(s in held for s in firsts(parallel)), any(s in held for s in lasts(parallel))
    mine = [i + offset for s in held for i in bounds[s]]
    if offset:
        tied_copy = model.tied and last and not first
        mine = ([0] if first or tied_copy else []) + mine + ([len(units) - 1] if last else [])
    return [units[i] for i in mine if units[i][1]]


def sizes(units: list[tuple[int, int]], dp: int, e: int) -> accounting.Sizes:
    """lesson 07's `Sizes` of these units on dp ranks at e bytes an element."""
    return accounting.Sizes(
        sum(n for n, _ in units), sum(ceil_div(n, dp) for n, _ in units), sum(t for _, t in units), len(units), dp, e
    )


def model_states(
    units: list[tuple[int, int]], zero: str, dp: int, precision: Precision, grad_bytes: int = 0, bf16_moments=False
) -> dict[str, int]:
    """Bytes of each model-state item this rank holds after a step (lesson 07's items, see the docstring);
    `grad_bytes` 4: float32 gradients under mixed precision (Megatron-LM's and DeepSpeed's default), the
    gradient items of lesson 07's table at 4 bytes: 18 bytes a parameter under DDP, not 16. `bf16_moments`
    (DeepSeek-V3's report, section 3.3.3, "Low-Precision Optimizer States"): AdamW's two moments of every
    element this rank steps at 2 bytes each, not 4: 2 x 2 x (Psi, or its shard) bytes, half the float32 ones."""
    if not units:
        return {}
    out = _model_states(units, zero, dp, precision, grad_bytes)
    if bf16_moments and precision.mixed:
        out["moments"] //= 2  # 2 x 4 bytes an element stepped -> 2 x 2
    return out


def _model_states(units: list[tuple[int, int]], zero: str, dp: int, precision: Precision, grad_bytes: int):
    if not precision.mixed:
        return accounting.held(zero, sizes(units, dp, precision.e))
    if zero == "DDP":
        at2 = sizes(units, dp, 2)
        out = accounting.expected_states_mixed(at2.psi, at2.tensors)
        return out | ({"gradients": 4 * at2.psi} if grad_bytes == 4 else {})
    low, high = accounting.held(zero, sizes(units, dp, 2)), accounting.held(zero, sizes(units, dp, 4))
    master = high.get("shard copy", 4 * sizes(units, dp, 4).shard)  # ZeRO-3: a float32 shard beside the bf16
    gradients = (high if grad_bytes == 4 else low)["gradients"]
    if zero == "ZeRO-1":  # Megatron-LM's distributed optimizer (docstring): the whole gradient buffer, reduce-
        # scattered in place; AdamW steps float32 main gradients, a shard of their own beside a bf16 buffer
        psi = sizes(units, dp, 1)
        gradients = 4 * psi.psi if grad_bytes == 4 else 2 * psi.psi + 4 * psi.shard
    return {
        "weights": low["weights"],
        "gradients": gradients,
        "master copy": master,
        "moments": high["moments"],
        "step counts": low["step counts"],
    }


def _block_config(model: Transformer, rows: int, seq: int, e: int) -> BlockConfig:
    return BlockConfig(model.one_block(), rows, seq, dropout=0.0, dtype=DTYPE_OF[e])


def block_activations(
    model: Transformer,
    rows: Batch,
    parallel: Parallel,
    e: int,
    stat_bytes: int,
    math: bool = False,
    moe: bool = False,
) -> Fraction:
    """Bytes one block keeps for backward, plus its output, on one rank, for the rows.global_batch sequences of
    rows.seq tokens this rank holds (docstring). `math`: torch's attention on its math path, which keeps the
    softmax (`sdpa_math_path`); `moe`: a block whose MLP is a mixture of experts."""
    rows, seq = rows.global_batch, rows.seq
    tp, cp, tokens = parallel.tp, parallel.cp, rows * (seq // parallel.cp)
    if model.attention == "written":
        whole = accounting.block_activations(rows, seq, model.dim, model.heads, e, stat_bytes)
        return Fraction(whole - 2 * e * tokens * model.dim)  # less the input and the target
    cfg = _block_config(model, rows, seq // cp, e)
    math = math and not parallel.selective  # Megatron's selective: the softmax (and its dropout) rebuilt, not kept
    base = activation_bytes(cfg, tp, parallel.sp, math)
    if parallel.cut_gathered:  # Megatron-LM keeps the gathered inputs cut too
        base -= Fraction(e * activation_terms(cfg)[1] * (tp - 1), tp)
    # Llama's options, against the lessons' block: k, v of T d_kv; a fused SwiGLU saves three T d_ff
    # tensors (its gate's and up's outputs, the product fc2 multiplies), GELU two (fc1's output, GELU's)
    width = model.ffn
    inside = tokens * (2 * (model.kv_dim - model.dim) + (width if model.gated else 0))
    if model.mla:  # the latents and their norms' inputs, q and k widened by the rotary part, v of h d_h
        h = model.heads
        inside = tokens * (
            2 * (model.q_rank + model.kv_rank) + h * (2 * model.qk_dim + 2 * model.head_dim) - 4 * model.dim
        )
    if moe:  # the planner's estimate: each token's top_k (and shared) experts save what one gated MLP of
        # their width saves, the routed copies of its input, its router's scores; the dense MLP's do not exist
        per = 3 if model.gated else 2
        experts = (model.top_k + model.shared_experts) * per * model.expert_ffn
        inside += tokens * (experts - per * width + model.top_k * model.dim + model.experts)
        width = (model.top_k + model.shared_experts) * model.expert_ffn
    if parallel.act_fn:  # the activation function's output is rebuilt in backward, not kept
        inside -= tokens * width
    # the norms' statistics, in the region: priced at stat_bytes, not e; RMSNorm keeps one per row, not two
    statistics = tokens * LN_STATISTICS // (2 if model.rms_norm else 1)
    region = (stat_bytes - e) * statistics - (e * tokens * LN_STATISTICS // 2 if model.rms_norm else 0)
    saved = sum(measure_savings(model, tokens, parallel, e, moe).values())
    return base + Fraction(e * inside, tp) + Fraction(region, tp if parallel.sp else 1) - saved


FP8_BYTES = Fraction(1) + Fraction(4, 128)  # an FP8 element and its share of a float32 scale per 1 x 128 tile
E5M6_BYTES = Fraction(12, 8) + Fraction(4, 128)  # DeepSeek-V3's 12-bit format for the input of attention's out


def measure_savings(model: Transformer, tokens: int, parallel: Parallel, e: int, moe: bool) -> dict[str, Fraction]:
    """Bytes one block's kept activations shrink by, on one rank, under each of DeepSeek-V3's activation
    measures `parallel.measures` takes (`distlab.cost.inputs.MEASURES`; its technical report,
    https://arxiv.org/abs/2412.19437), on T = `tokens` tokens, from the terms `block_activations` keeps
    (elements per token; / tp: what tensor parallelism cuts; g: the gathered inputs, whole on every rank, or
    cut by tp when `cut_gathered`):

    recompute-norm-up (section 3.2.3, "Recomputation of RMSNorm and MLA Up-Projection"): every RMSNorm's output
      and MLA's up-projections are rebuilt in backward from what stays kept (the residual stream, the latents),
      so their outputs are not kept:  e T (2d at g  +  (q_rank + kv_rank + h (2 d_qk + d_h)) / tp)
      (LN_1's and LN_2's outputs; the latent norms' outputs; q, k of h d_qk, v of h d_h); without MLA, the
      norms' outputs alone.
    fp8-activations (section 3.3.3, "Low-Precision Storage"): the input a Linear keeps for its weight's
      gradient is cached in FP8 (f = 1 + 4/128 bytes: an element and its share of one float32 scale per
      1 x 128 tile), the input of attention's out-projection in E5M6 (f' = 12/8 + 4/128), the SwiGLU's
      inputs in a mixture of experts in FP8 with its output rebuilt in backward:
          (e - f) T (2d at g  +  (q_rank + kv_rank) / tp)    the norms' outputs, unless rebuilt above
        + (e - f') T h d_h / tp                              attention's output
        + (e - f) T top_k d / tp                            the routed copies of the experts' input
        + T (k + s) ((e - f) a + e) d_e / tp                the experts' activation inputs (a = 2 gated, 1)
                                                            in FP8, their output not kept (unless act-fn already)
        + (e - f) T d_ff / tp                                a dense MLP's fc2 input, unless act-fn rebuilt it
    (bf16-moments, the third, shrinks the optimizer's states: `model_states`.)"""
    tp, out = parallel.tp, {}
    g = Fraction(1, tp) if parallel.cut_gathered else Fraction(1)
    latents = model.q_rank + model.kv_rank if model.mla else 0
    rebuilt = "recompute-norm-up" in parallel.measures
    if rebuilt:
        up = model.heads * (2 * model.qk_dim + model.head_dim) if model.mla else 0
        out["recompute-norm-up"] = e * tokens * (2 * model.dim * g + Fraction(latents + up, tp))
    if "fp8-activations" in parallel.measures:
        less = e - FP8_BYTES
        saved = 0 if rebuilt else less * tokens * (2 * model.dim * g + Fraction(latents, tp))
        saved += (e - E5M6_BYTES) * tokens * Fraction(model.heads * model.head_dim, tp)
        if moe:
            a = 2 if model.gated else 1
            experts = model.top_k + model.shared_experts
            product = 0 if parallel.act_fn else e
            saved += Fraction(
                tokens * (less * model.top_k * model.dim + experts * (less * a + product) * model.expert_ffn), tp
            )
        elif not parallel.act_fn:
            saved += less * tokens * Fraction(model.ffn, tp)
        out["fp8-activations"] = Fraction(saved)
    return out


def stage_activations(
    model, batch: Batch, parallel: Parallel, stage: int, precision: Precision, stat_bytes: int, math: bool = False
):
    """Bytes one micro-batch leaves on pipeline stage `stage` for its backward (and its output)."""
    rows, e = batch.global_batch // (parallel.dp * batch.micro_batches), precision.e
    layers, last = stage_layers(model, parallel)[stage], stage in lasts(parallel)
    if isinstance(model, Mlp):
        widths = model.widths[layers.start : layers.stop + 1]
        return accounting.mlp_activations(rows, widths, e) - (0 if last else e * rows * widths[-1])
    tokens = rows * (batch.seq // parallel.cp) // (parallel.tp if parallel.sp else 1)
    if parallel.recompute:
        kept = e * tokens * model.dim * len(layers)
    else:
        kept = sum(
            block_activations(model, Batch(rows, batch.seq), parallel, e, stat_bytes, math, model.is_moe(i))
            for i in layers
        )
    if model.vocab and stage in firsts(parallel):
        kept += e * tokens * model.dim  # the embedding's output, the first block's input
    return int(kept) if kept == int(kept) else kept  # whole bytes wherever tp cuts the terms evenly


def activation_parts(
    model, batch: Batch, parallel: Parallel, precision: Precision, pp_rank: int, stat_bytes: int, math: bool = False
) -> dict[str, int]:
    """The rank's activations at its peak, in two parts: one micro-batch's (its largest stage's, and with
    recomputation one block's whole activations, rebuilt for its backward), and the pipeline's in flight:
    the other micro-batches the schedule holds at once."""
    held = stages(parallel, batch, pp_rank)
    per = max(stage_activations(model, batch, parallel, s, precision, stat_bytes, math) for s in held)
    one = per
    if parallel.recompute and isinstance(model, Transformer):  # one block's whole activations, rebuilt for its backward
        rows = batch.global_batch // (parallel.dp * batch.micro_batches)
        moe = model.experts > 0 and model.dense_layers < model.layers
        one += block_activations(model, Batch(rows, batch.seq), parallel, precision.e, stat_bytes, math, moe)
    extra = (in_flight(parallel, batch, pp_rank) - 1) * per
    return {"activations": int(one + extra) - int(extra), "pipeline in-flight": int(extra)}


def activations(
    model, batch: Batch, parallel: Parallel, precision: Precision, pp_rank: int, stat_bytes: int, math: bool = False
) -> int:
    """The rank's activations at its peak: its largest stage's, times the micro-batches it holds at once."""
    return sum(activation_parts(model, batch, parallel, precision, pp_rank, stat_bytes, math).values())


def buffers(model, batch: Batch, parallel: Parallel, precision: Precision, pp_rank: int) -> int:
    """The planner's estimate of transient buffers (docstring): not measured by any lesson."""
    if isinstance(model, Mlp):
        return 0
    e, rows = precision.e, batch.global_batch // (parallel.dp * batch.micro_batches)
    units = rank_units(model, parallel, pp_rank, batch)
    out = 2 * e * max(n for n, _ in units) if parallel.zero == "ZeRO-3" and parallel.dp > 1 else 0
    if parallel.cp > 1:
        heads = (model.kv_heads or model.heads) // parallel.tp
        out += rows * RingSizes(heads, batch.seq, model.head_dim, parallel.cp, e).memory_bound()[1]
    if model.vocab and any(s in lasts(parallel) for s in stages(parallel, batch, pp_rank)):
        out += rows * (batch.seq // parallel.cp) * (model.vocab // parallel.tp) * (e + 4)  # logits, log-softmax
    if parallel.ep > 1:  # one MoE layer's all-to-all: the routed copies sent, and as many received
        out += 2 * rows * (batch.seq // parallel.cp) * model.top_k * model.dim * e
    return out


def states(model, batch: Batch, parallel: Parallel, precision: Precision, pp_rank: int) -> dict[str, int]:
    """The model states: the dense weights' ZeRO-sharded over dp, the routed experts' over dp / ep."""
    low = "bf16-moments" in parallel.measures
    mine = rank_units(model, parallel, pp_rank, batch)
    dense = model_states(mine, parallel.zero, parallel.dp, precision, parallel.grad_bytes, low)
    routed = rank_units(model, parallel, pp_rank, batch, experts=True) if getattr(model, "experts", 0) else []
    experts = model_states(routed, parallel.zero, parallel.dp // parallel.ep, precision, parallel.grad_bytes, low)
    return {k: dense.get(k, 0) + experts.get(k, 0) for k in dict.fromkeys([*dense, *experts])}


def per_rank(model, batch: Batch, parallel: Parallel, precision: str, pp_rank: int = 0, device: str = "cpu"):
    """Every item one rank of pipeline position `pp_rank` holds after a step, in bytes (`device`: where
    LayerNorm's statistics' dtype and torch's attention path are decided)."""
    p = PRECISIONS[precision]
    stat_bytes = accounting.layer_norm_stat_bytes(p.e, device)
    math = sdpa_math_path(device, DTYPE_OF[p.e])
    items = states(model, batch, parallel, p, pp_rank)
    items["activations"] = activations(model, batch, parallel, p, pp_rank, stat_bytes, math)
    items["buffers"] = buffers(model, batch, parallel, p, pp_rank)
    return items
