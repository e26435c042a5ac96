"""The models the planner knows by name, and the published training runs it is checked against.

Model sizes are the published ones (Llama 3: "The Llama 3 Herd of Models", Table 3,
https://arxiv.org/abs/2407.21783; GPT-3 175B as Megatron-LM's README trains it, vocabulary 131,072). A run
in `PUBLISHED` is a configuration someone trained and reported, with what they reported: where it ran (the
predicted memory must fit there) and its MFU (the predicted MFU is set beside it, README "Checked against
published runs"). What a report leaves out is stated as the planner's choice in `assumed`.
"""

from __future__ import annotations

from dataclasses import dataclass

from distlab.cost.dims import ParallelDims
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

MODELS = {
    "gpt2-124m": Transformer(12, 768, 12, 3072, 50304, tied=True),  # nanoGPT's: vocabulary padded to 50,304
    "llama3-8b": llama(32, 4096, 32, 14336),
    "llama3-70b": llama(80, 8192, 64, 28672),
    "llama3-405b": llama(126, 16384, 128, 53248),
    "gpt3-175b": Transformer(96, 12288, 96, 4 * 12288, 131072),
    "deepseek-v3": DEEPSEEK_V3,
}
PUBLISHED_PARAMETERS = {"gpt2-124m": 124e6, "llama3-405b": 405e9, "deepseek-v3": 671e9}  # as their papers round

LLAMA3 = "The Llama 3 Herd of Models, Table 4 (https://arxiv.org/abs/2407.21783)"
TORCHTITAN = "torchtitan docs/performance.md (https://github.com/pytorch/torchtitan/blob/main/docs/performance.md)"


@dataclass(frozen=True)
class Published:
    """A reported run: its model, GPU and count, batch and split, and the MFU it reported."""

    name: str
    model: str  # a key of MODELS
    gpu: str  # a key of distlab.cost.hardware.DEVICES
    batch: Batch
    parallel: Parallel
    reported_mfu: float
    source: str
    assumed: str  # what the report does not say, chosen here
    full_square: bool = False  # the report's MFU counts causal attention's whole seq^2 (torchtitan's formula)


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
)
