"""What tensor and sequence parallelism cost per rank, in closed form (lesson 08).

Bytes (ring accounting of lesson 06, `distlab.comm.collectives`; e bytes per element; N seq d elements in
the block's activation):

    tensor parallel, per MLP or attention, per step:   forward  all-reduce 2(P-1)/P N seq d e  (g)
                                                       backward all-reduce 2(P-1)/P N seq d e  (f)
    sequence parallel, the same:                       forward  all-gather + reduce-scatter, (P-1)/P N seq d e each
                                                       backward reduce-scatter + all-gather, the same
                                                       after backward: all-reduce 2(P-1)/P 6d e (LayerNorms, row biases)

so the activations' bytes are equal; sequence parallelism adds only the 6 d-vectors' gradients.

Activation memory of one block's forward per rank: what it leaves alive for backward, plus its output
(elements; torch 2.13's autograd on this block, every tensor it keeps named):

    between the parallel layers: region   = N seq (2d + 4)   y and z (N seq d each), LN_1 and LN_2's mean
                                             and 1/std (N seq each): cut by P under sequence parallelism
    inputs of q, k, v and fc1:   gathered = 2 N seq d        whole on every rank, in both
    inside the parallel layers:  inside   = N seq (4d + 2 d_ff) + kept      q, k, v, the heads' output,
                                             fc1's output and GELU's, and what attention keeps (`sdpa_kept`):
                                             kept = N h seq, a log-sum-exp per head and row, where a fused
                                             kernel runs; N h seq^2, the softmax itself, on the math path
                                             (float64 on CUDA: `sdpa_math_path`)

    tensor parallel:   region + gathered + inside / P      sequence parallel:   (region + inside) / P + gathered

(Megatron-LM also keeps `gathered` cut, saving each rank's part and all-gathering it again in backward.)
"""

from __future__ import annotations

from fractions import Fraction

import torch

from distlab.comm.collectives import ring_fraction
from distlab.layer_split.tensor_parallel.model import BlockConfig

PARTS_IN = {"mlp": 1, "attention": 1, "block": 2}  # (enter, exit) pairs per forward


def expected_traffic(
    cfg: BlockConfig, part: str, world_size: int, sequence_parallel: bool, steps: int = 1
) -> dict[tuple[str, str], Fraction]:
    """Bytes this rank sends, by (direction, collective), in `steps` steps of `part`: exact fractions, whole
    numbers wherever P cuts the tensors evenly (what a `Ledger` of the run counts)."""
    e = cfg.dtype.itemsize
    act = Fraction(cfg.batch * cfg.seq * cfg.model.dim * e) * PARTS_IN[part] * steps
    frac = {kind: ring_fraction(kind, world_size) for kind in ("all_reduce", "all_gather", "reduce_scatter")}
    if not sequence_parallel:
        return {
            ("forward", "all_reduce"): frac["all_reduce"] * act,
            ("backward", "all_reduce"): frac["all_reduce"] * act,
        }
    out = {
        (direction, kind): frac[kind] * act
        for direction in ("forward", "backward")
        for kind in ("all_gather", "reduce_scatter")
    }
    cut = {"mlp": 1, "attention": 1, "block": 6}[part]  # d-vectors whose gradients are partial sums
    out["gradients", "all_reduce"] = frac["all_reduce"] * cut * cfg.model.dim * e * steps
    return out


def sdpa_math_path(device_type: str, dtype: torch.dtype) -> bool:
    """Whether torch's scaled_dot_product_attention takes its math path (composite ops, the softmax kept) rather
    than a fused kernel for this block: on CUDA in float64, which none of its fused kernels takes (flash: fp16 and
    bf16; memory-efficient: those and float32). The CPU's flash kernel takes float32 and float64."""
    return device_type == "cuda" and dtype == torch.float64


def sdpa_kept(cfg: BlockConfig, math: bool = False) -> int:
    """Elements attention keeps for backward beyond q, k, v and its output: a fused kernel one log-sum-exp per
    head and row, N h seq; the math path the softmax itself, N h seq^2 (measured on an H100, float64: 502,272
    bytes a block at lesson 08's defaults against the CPU's 350,208, 8 N h seq (seq - 1) more)."""
    return cfg.batch * cfg.model.heads * cfg.seq * (cfg.seq if math else 1)


def activation_terms(cfg: BlockConfig, math: bool = False) -> tuple[int, int, int]:
    """(region, gathered, inside) of the docstring, in elements; `math`: attention on its math path."""
    tokens = cfg.batch * cfg.seq
    inside = tokens * (4 * cfg.model.dim + 2 * cfg.model.ffn) + sdpa_kept(cfg, math)
    return tokens * (2 * cfg.model.dim + 4), 2 * tokens * cfg.model.dim, inside


def activation_bytes(cfg: BlockConfig, world_size: int, sequence_parallel: bool, math: bool = False) -> Fraction:
    region, gathered, split = activation_terms(cfg, math)
    region_part = Fraction(region, world_size) if sequence_parallel else region
    return (region_part + gathered + Fraction(split, world_size)) * cfg.dtype.itemsize


LSE_ALIGN = 32  # CUDA's memory-efficient attention pads its saved log-sum-exp to a multiple of 32 queries


def efficient_attention_extra(rows: int, heads: int, seq: int) -> int:
    """Bytes CUDA's memory-efficient attention keeps for backward beyond `sdpa_kept`'s N h seq float32
    log-sum-exps, per call on `rows` sequences and `heads` heads. It is the kernel SDPA takes for float32 on
    CUDA (flash takes fp16 and bf16 only). Read from PyTorch's source
    (aten/src/ATen/native/transformers/cuda/attention.cu, `_efficient_attention_forward`):
      - the log-sum-exp it returns, and autograd saves, is float32 of shape (rows, heads, ceil(seq / 32) 32)
        ("padded in case M is not a good number for loading during backward"), not (rows, heads, seq);
      - it returns the dropout generator's seed and offset too, two int64 scalars that backward reads, made
        (0-dim CPU tensors) and saved even without dropout: 16 bytes a call.
    So 4 rows heads (ceil(seq / 32) 32 - seq) + 16 bytes: at lesson 13's 12 x 12 x 48, 9,232 a block."""
    padded = -(-seq // LSE_ALIGN) * LSE_ALIGN
    return 4 * rows * heads * (padded - seq) + 2 * 8
