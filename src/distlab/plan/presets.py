"""The models the planner knows by name, and the published training runs it is checked against.

Model sizes are the published ones (Llama 3: "The Llama 3 Herd of Models", Table 3,
https://arxiv.org/abs/2407.21783; GPT-3 175B as Megatron-LM's README trains it, vocabulary 131,072). A run
in `PUBLISHED` is a configuration someone trained and reported, with what they reported: where it ran (the
predicted memory must fit there) and its MFU (the predicted MFU is set beside it, README "Checked against
published runs"). What a report leaves out is stated as the planner's choice in `assumed`.
"""

from __future__ import annotations

from dataclasses import dataclass

from distlab.cost.shapes import Batch, Parallel, Transformer


def llama(layers: int, dim: int, heads: int, ffn: int) -> Transformer:
    """A Llama 3 model: grouped-query attention (8 key/value heads), SwiGLU, RMSNorm, no biases, an untied
    head over a 128,256-token vocabulary."""
    return Transformer(layers, dim, heads, ffn, 128256, kv_heads=8, gated=True, bias=False, rms_norm=True)


MODELS = {
    "llama3-8b": llama(32, 4096, 32, 14336),
    "llama3-70b": llama(80, 8192, 64, 28672),
    "llama3-405b": llama(126, 16384, 128, 53248),
    "gpt3-175b": Transformer(96, 12288, 96, 4 * 12288, 131072),
}

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


# Llama 3 405B: DP is FSDP that does not reshard the weights after forward (it holds what ZeRO-2 holds);
# sequence parallelism as Megatron-LM's; no activation recomputation at 8K tokens (paper, section 3.3.2).
_LLAMA_SPLIT = dict(zero="ZeRO-2", tp=8, sp=True, cut_gathered=True, pp=16)
PUBLISHED = (
    Published(
        "Llama 3 405B, 8,192 H100",
        "llama3-405b",
        "h100",
        Batch(2048, 8192, 32),
        Parallel(dp=64, **_LLAMA_SPLIT),
        0.43,
        LLAMA3,
        "1F1B (theirs: an interleaved schedule of unreported depth); micro-batches of 1 sequence",
    ),
    Published(
        "Llama 3 405B, 16,384 H100",
        "llama3-405b",
        "h100",
        Batch(2048, 8192, 16),
        Parallel(dp=128, **_LLAMA_SPLIT),
        0.41,
        LLAMA3,
        "1F1B (theirs: an interleaved schedule of unreported depth); micro-batches of 1 sequence",
    ),
    Published(
        "Llama 3 405B, 16,384 H100, 128K tokens",
        "llama3-405b",
        "h100",
        Batch(128, 131072, 16),
        Parallel(dp=8, cp=16, **_LLAMA_SPLIT),
        0.38,
        LLAMA3,
        "1F1B; micro-batches of 1 sequence",
    ),
    Published(
        "torchtitan Llama 3 8B, 64 A100",
        "llama3-8b",
        "a100",
        Batch(64, 8192, 1),
        Parallel(dp=64, zero="ZeRO-3"),
        0.582,
        TORCHTITAN,
        "FSDP2 = ZeRO-3, local batch 1; their selective op recomputation not modelled",
    ),
    Published(
        "torchtitan Llama 3 70B, 64 A100",
        "llama3-70b",
        "a100",
        Batch(64, 8192, 1),
        Parallel(dp=64, zero="ZeRO-3", recompute=True),
        0.517,
        TORCHTITAN,
        "FSDP2 = ZeRO-3, local batch 1, full recomputation",
    ),
)
