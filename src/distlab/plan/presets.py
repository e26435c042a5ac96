"""The models the planner knows by name, and the published training runs it is checked against.

Model sizes are the published ones (Llama 3: "The Llama 3 Herd of Models", Table 3,
https://arxiv.org/abs/2407.21783; GPT-3 175B as Megatron-LM's README trains it, vocabulary 131,072). A run
in `PUBLISHED` is a configuration someone trained and reported, with what they reported: where it ran (the
predicted memory must fit there) and its MFU (the predicted MFU is set beside it, README "Checked against
published runs"). What a report leaves out is stated as the planner's choice in `assumed`.
"""

from __future__ import annotations

from dataclasses import dataclass

from distlab.composed.dims import ParallelDims
from distlab.cost.inputs import Batch, Parallel
from distlab.proof.sizes import Transformer


def llama(layers: int, dim: int, heads: int, ffn: int) -> Transformer:
    """A Llama 3 model: grouped-query attention (8 key/value heads), SwiGLU, RMSNorm, no biases, an untied
    head over a 128,256-token vocabulary."""
    return Transformer(layers, dim, heads, ffn, 128256, kv_heads=8, gated=True, bias=False, rms_norm=True)


# DeepSeek-V3 (https://arxiv.org/abs/2412.19437, section 4.2 and its config.json): 61 blocks of d = 7,168,
# multi-head latent attention (128 heads of d_h = 128, a 1,536-wide query latent, a 512-wide key/value
# latent, 64 rotary dimensions), the first 3 blocks dense (d_ff = 18,432), the other 58 a mixture of 256
# routed experts (top-8) and 1 shared expert, each 2,048 wide; a 129,280-token vocabulary, untied. 671 B
# parameters, 37 B active per token (the multi-token-prediction module, 14 B more, is not counted).
DEEPSEEK_V3 = Transformer(
    61,
    7168,
    128,
    18432,
    129280,
    gated=True,
    bias=False,
    rms_norm=True,
    head_size=128,
    q_rank=1536,
    kv_rank=512,
    rope_dim=64,
    experts=256,
    top_k=8,
    expert_ffn=2048,
    shared_experts=1,
    dense_layers=3,
)

# MT-NLG 530B ("Using DeepSpeed and Megatron to Train Megatron-Turing NLG 530B", Smith et al. 2022,
# https://arxiv.org/abs/2201.11990, section 2): 105 blocks, d = 20,480, 128 heads, GPT-2's 50,257-token
# vocabulary padded to 51,200 (Megatron-LM pads to a multiple of 128 x tp = 1,024), embeddings tied.
# BLOOM 176B ("BLOOM: A 176B-Parameter Open-Access Multilingual Language Model", https://arxiv.org/abs/2211.05100,
# section 3.4; BigScience's 176B model card): 70 blocks, d = 14,336, 112 heads, a 250,880-row (padded)
# embedding, tied; ALiBi adds no parameters.
MT_NLG = Transformer(105, 20480, 128, 4 * 20480, 51200, tied=True)
BLOOM = Transformer(70, 14336, 112, 4 * 14336, 250880, tied=True)

MODELS = {
    "gpt2-124m": Transformer(12, 768, 12, 3072, 50304, tied=True),  # nanoGPT's: vocabulary padded to 50,304
    "llama3-8b": llama(32, 4096, 32, 14336),
    "llama3-70b": llama(80, 8192, 64, 28672),
    "llama3-405b": llama(126, 16384, 128, 53248),
    "gpt3-175b": Transformer(96, 12288, 96, 4 * 12288, 131072),
    "deepseek-v3": DEEPSEEK_V3,
    "mt-nlg-530b": MT_NLG,
    "bloom-176b": BLOOM,
}
PUBLISHED_PARAMETERS = {"gpt2-124m": 124e6, "llama3-405b": 405e9, "deepseek-v3": 671e9}  # as their papers round

LLAMA3 = "The Llama 3 Herd of Models, Table 4 (https://arxiv.org/abs/2407.21783)"
TORCHTITAN = "torchtitan docs/performance.md (https://github.com/pytorch/torchtitan/blob/main/docs/performance.md)"
MT_NLG_PAPER = "Smith et al., Megatron-Turing NLG 530B, section 2.4 (https://arxiv.org/abs/2201.11990)"
BLOOM_CARD = "BigScience 176B model page: 384 A100 80GB, 48 GPUs a replica, about 150 TFLOPs (bigscience.notion.site)"


@dataclass(frozen=True)
class Published:
    """A reported run: its model, GPU and count, batch and split, and what it reported: its MFU, or its seconds
    a step, or its TFLOP/s a GPU counted as Megatron-LM counts them (recomputation and the whole seq^2 square
    included, `tflops`). `fitted`: its stack's profile was fitted on it; else it is held out, a check."""

    name: str
    model: str  # a key of MODELS
    gpu: str  # a key of distlab.proof.hardware.DEVICES
    batch: Batch
    parallel: Parallel
    reported_mfu: float
    source: str
    assumed: str  # what the report does not say, chosen here
    full_square: bool = False  # the report's MFU counts causal attention's whole seq^2 (torchtitan's formula)
    stack: str = "megatron-lm"  # a key of distlab.cost.stacks.STACKS
    fitted: bool = False
    reported_step_s: float = 0.0  # when the report gives seconds a step instead of MFU
    reported_tflops: float = 0.0  # when it gives hardware TFLOP/s a GPU (Megatron-LM's count) instead
    inter_node_gbps: float | None = None  # the network's Gb/s a GPU where it is not the GPU's usual NIC


# Llama 3 405B: DP is FSDP that does not reshard the weights after forward (it holds what ZeRO-2 holds);
# sequence parallelism as Megatron-LM's; no activation recomputation at 8K tokens; an interleaved schedule
# (paper, section 3.3.2) of unreported depth: the shallowest, v = 2, here.
_LLAMA_SPLIT = dict(zero="ZeRO-2", sp=True, cut_gathered=True, schedule="interleaved-1f1b", stages_per_rank=2)
_LLAMA_ASSUMED = "interleaved v = 2 (theirs: interleaved, depth unreported); micro-batches of 1 sequence"
PUBLISHED = (
    Published(
        "Llama 3 405B, 8,192 H100",
        "llama3-405b",
        "h100",
        Batch(2048, 8192, 32),
        Parallel(ParallelDims(dp=64, tp=8, pp=16), **_LLAMA_SPLIT),
        0.43,
        LLAMA3,
        _LLAMA_ASSUMED + "; at M = 32 the cost model's activations in flight exceed the GPU (see the README)",
        fitted=True,
    ),
    Published(
        "Llama 3 405B, 16,384 H100",
        "llama3-405b",
        "h100",
        Batch(2048, 8192, 16),
        Parallel(ParallelDims(dp=128, tp=8, pp=16), **_LLAMA_SPLIT),
        0.41,
        LLAMA3,
        _LLAMA_ASSUMED,
        fitted=True,
    ),
    Published(
        "Llama 3 405B, 16,384 H100, 128K tokens",
        "llama3-405b",
        "h100",
        Batch(128, 131072, 16),
        Parallel(ParallelDims(dp=8, cp=16, tp=8, pp=16), **_LLAMA_SPLIT),
        0.38,
        LLAMA3,
        _LLAMA_ASSUMED + "; the k/v exchange priced as lesson 09's ring, hidden behind attention",
        fitted=True,
    ),
    Published(
        "torchtitan Llama 3 8B, 64 A100",
        "llama3-8b",
        "a100",
        Batch(64, 8192, 1),
        Parallel(ParallelDims(dp=64), zero="ZeRO-3"),
        0.582,
        TORCHTITAN,
        "FSDP2 = ZeRO-3, local batch 1; their selective op recomputation not modelled; MFU by their formula",
        True,
    ),
    Published(
        "torchtitan Llama 3 70B, 64 A100",
        "llama3-70b",
        "a100",
        Batch(64, 8192, 1),
        Parallel(ParallelDims(dp=64), zero="ZeRO-3", recompute=True),
        0.517,
        TORCHTITAN,
        "FSDP2 = ZeRO-3, local batch 1, full recomputation; MFU by their formula",
        True,
    ),
    *(
        Published(
            f"MT-NLG 530B, {gpus:,} A100",
            "mt-nlg-530b",
            "a100",
            Batch(1920, 2048, 1920 // dp),
            Parallel(ParallelDims(dp=dp, tp=8, pp=35), "ZeRO-1", recompute=True),
            0.0,
            MT_NLG_PAPER,
            "8-way tensor, 35-way pipeline (1F1B), micro-batches of 1 sequence, full recomputation, ZeRO-1",
            stack="megatron-deepspeed",
            fitted=dp == 8,
            reported_step_s=step,
        )
        for gpus, dp, step in ((2240, 8, 60.1), (2800, 10, 50.2), (3360, 12, 44.4))
    ),
    Published(
        "BLOOM 176B, 384 A100",
        "bloom-176b",
        "a100",
        Batch(2048, 2048, 128),
        Parallel(ParallelDims(dp=8, tp=4, pp=12), "ZeRO-1", recompute=True),
        0.0,
        BLOOM_CARD,
        "tp 4 x pp 12 = the 48 GPUs a replica (published), dp 8; micro-batches of 2 sequences, full recomputation "
        "and ZeRO-1 as Megatron-DeepSpeed ran them (not in the card); 4 x 100 Gb/s Omni-Path a node (the paper)",
        stack="megatron-deepspeed",
        reported_tflops=150.0,
        inter_node_gbps=50.0,
    ),
)
