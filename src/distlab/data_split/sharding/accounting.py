"""What a training step holds, item by item, in bytes per rank: the formulas lesson 07 checks.

Psi parameters in `tensors` tensors, split into `units` layers; P ranks; e bytes per element of the
weights, gradients and AdamW moments (8 in float64). A sharded item keeps Psi_P = sum_u ceil(Psi_u / P)
elements per rank (Psi_P = Psi / P when P divides every layer's Psi_u; `distlab.data_split.sharding.flat`).

| item                     | DDP       | ZeRO-1              | ZeRO-2     | ZeRO-3     |
|--------------------------|-----------|---------------------|------------|------------|
| weights                  | e Psi     | e Psi               | e Psi      | e Psi_P    |
| gradients                | e Psi     | e Psi + e Psi_P     | e Psi_P    | e Psi_P    |
| optimizer's shard copy   | -         | e Psi_P             | e Psi_P    | -          |
| AdamW moments m, v       | 2 e Psi   | 2 e Psi_P           | 2 e Psi_P  | 2 e Psi_P  |
| AdamW step counts        | 4 tensors | 4 units             | 4 units    | 4 units    |

ZeRO-1 still receives the whole gradient from backward, then reduce-scatters it into a shard (its
own e Psi_P); ZeRO-2 reduce-scatters each layer's gradient as soon as backward has made it and frees the
whole one; ZeRO-1/2 step a copy of their shard of the weights (the float32 master copy, under mixed
precision) and all-gather the result into the weights; ZeRO-3's shard is the only copy of the weights.

Mixed precision (bf16 weights and gradients, a float32 master copy and float32 moments,
`distlab.data_split.sharding.mixed`) prices the same items at e = 2 but the moments at e_m = 4 bytes, and adds the
master copy that AdamW steps: e_m Psi under DDP, e_m Psi_P beside each stage's bf16 shard (`Sizes.e_m`;
in one dtype e_m = e and there is no master):

| stage  | weights | gradients       | shard copy | master copy | moments    | bytes per rank      |
|--------|---------|-----------------|------------|-------------|------------|---------------------|
| DDP    | 2 Psi   | 2 Psi           | -          | 4 Psi       | 8 Psi      | 16 Psi              |
| ZeRO-1 | 2 Psi   | 2 Psi + 2 Psi_P | 2 Psi_P    | 4 Psi_P     | 8 Psi_P    | 4 Psi + 16 Psi_P    |
| ZeRO-2 | 2 Psi   | 2 Psi_P         | 2 Psi_P    | 4 Psi_P     | 8 Psi_P    | 2 Psi + 16 Psi_P    |
| ZeRO-3 | 2 Psi_P | 2 Psi_P         | -          | 4 Psi_P     | 8 Psi_P    | 16 Psi_P            |

DDP's 16 Psi against 8 + 8 + 16 = 32 Psi in float64, and ZeRO-3's 16 Psi_P, are the ZeRO paper's
(Rajbhandari et al., section 5: 2 + 2 + K with K = 12 for the master and moments). Its ZeRO-1 and -2,
2 Psi + 2 Psi + 12 Psi_P and 2 Psi + 14 Psi_P, hold less: its bf16 shard is a slice of the whole bf16
weights, here a tensor of its own (2 Psi_P), and its ZeRO-1 keeps no gradient shard beside the whole
gradient, here the reduce-scatter's result (2 Psi_P).

Bytes each rank sends in one step (a ring: `distlab.comm.ring`, over the padded units of
P Psi_P elements): DDP's all-reduce 2 (P-1)/P e Psi; ZeRO-1 and ZeRO-2 a reduce-scatter of the gradients
and an all-gather of the weights, 2 (P-1) e Psi_P, the same as DDP; ZeRO-3 an all-gather for forward,
another for backward and a reduce-scatter, 3 (P-1) e Psi_P: one and a half times DDP's (less the
first layer's second gather, which backward never needs: `expected_bytes`).
"""

from __future__ import annotations

from dataclasses import dataclass

from distlab.data_split.sharding.flat import FlatUnit

STEP_COUNT_BYTES = 4  # AdamW keeps its step count as a float32 scalar tensor per parameter tensor
STAGES = ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3")


@dataclass(frozen=True)
class Sizes:
    """What the formulas need about a model on P ranks."""

    psi: int  # parameters, Psi
    shard: int  # Psi_P = sum_u ceil(Psi_u / P), one rank's elements of a sharded item
    tensors: int  # parameter tensors
    units: int  # layers (flat units)
    world: int  # ranks, P
    e: int  # bytes per element of the weights and gradients
    e_m: int | None = None  # of the moments and the master copy under mixed precision; None: e, no master

    def __post_init__(self):
        if self.e_m is None:
            object.__setattr__(self, "e_m", self.e)

    @property
    def mixed(self) -> bool:
        return self.e_m != self.e

    @classmethod
    def of(cls, units: list[FlatUnit], world: int, e: int, e_m: int | None = None) -> Sizes:
        return cls(
            sum(u.numel for u in units),
            sum(u.shard_numel for u in units),
            sum(len(u.sizes) for u in units),
            len(units),
            world,
            e,
            e_m,
        )


def held(stage: str, s: Sizes) -> dict[str, int]:
    """Bytes of each item one rank holds after a step (gradients not yet zeroed), by stage; under mixed
    precision (`s.mixed`) the moments at e_m bytes and the master copy of what AdamW steps."""
    full, shard, steps = s.e * s.psi, s.e * s.shard, STEP_COUNT_BYTES * s.units
    stepped = s.psi if stage == "DDP" else s.shard  # elements AdamW steps on this rank
    table = {
        "DDP": {"weights": full, "gradients": full, "step counts": STEP_COUNT_BYTES * s.tensors},
        "ZeRO-1": {"weights": full, "gradients": full + shard, "shard copy": shard, "step counts": steps},
        "ZeRO-2": {"weights": full, "gradients": shard, "shard copy": shard, "step counts": steps},
        "ZeRO-3": {"weights": shard, "gradients": shard, "step counts": steps},
    }[stage] | {"moments": 2 * s.e_m * stepped}
    return table | ({"master copy": s.e_m * stepped} if s.mixed else {})


def expected_bytes(stage: str, s: Sizes, first_shard: int = 0) -> int:
    """Bytes one rank sends in one step (a ring), by formula (a run's count is `StrategyRun.sent`). ZeRO-3
    gathers a layer again for backward only when backward reads its weights: the first layer's input needs
    no gradient, so its weights are not read (`first_shard` = its ceil(Psi_0 / P) elements, not gathered
    twice; 0 counts it, as FSDP2 does)."""
    per_pass = (s.world - 1) * s.shard * s.e  # one reduce-scatter or one all-gather of every unit
    if stage == "ZeRO-3":
        return 3 * per_pass - (s.world - 1) * first_shard * s.e
    return 2 * per_pass


def expected_states_one_dtype(psi: int, tensors: int, e: int) -> dict[str, int]:
    """The model states of one process (or one DDP rank) training in one dtype of e bytes, by formula (the
    measured side: `distlab.data_split.sharding.holds.measure_one_dtype_step`)."""
    return {"weights": e * psi, "gradients": e * psi, "moments": 2 * e * psi, "step counts": STEP_COUNT_BYTES * tensors}


def expected_states_mixed(psi: int, tensors: int) -> dict[str, int]:
    """bf16 weights and gradients, a float32 master copy and float32 moments, by formula (the measured side:
    `distlab.data_split.sharding.holds.measure_mixed_step`)."""
    return {
        "weights": 2 * psi,
        "gradients": 2 * psi,
        "master copy": 4 * psi,
        "moments": 8 * psi,
        "step counts": STEP_COUNT_BYTES * tensors,
    }


def layer_norm_stat_bytes(e: int, device_type: str) -> int:
    """Bytes per element of the mean and 1/std a LayerNorm saves for backward, for inputs of e bytes: on
    the CPU in the input's dtype; on CUDA in its accumulation type, float32 for bf16 and fp16 inputs
    (torch's `layer_norm_cuda` allocates them so), float64 for float64."""
    return max(e, 4) if device_type == "cuda" else e


def block_activations(rows: int, seq: int, d: int, heads: int, e: int, stat_bytes: int | None = None) -> int:
    """Bytes autograd saves in lesson 07's block, `distlab.proof.models.Block` with q, k, v from one fused
    product and attention written out (counted op by op, by storage as `distlab.proof.held` counts): 18 tensors of
    C x seq x d (input, LN1 output, q, k, v, the heads' merged output, LN2 input and output, the
    4d-wide fc1 output and GELU output (4 each), output and target), the softmax (C h seq^2), all
    of e bytes, and the two LayerNorms' mean and 1/std (4 C seq) of `stat_bytes` bytes (default e;
    `layer_norm_stat_bytes` gives the device's: on CUDA a bf16 block saves them in float32)."""
    stat_bytes = e if stat_bytes is None else stat_bytes
    return e * (18 * rows * seq * d + rows * heads * seq * seq) + stat_bytes * 4 * rows * seq


def mlp_activations(rows: int, widths: tuple[int, ...], e: int) -> int:
    """Bytes autograd saves for backward in `layered_mlp` under a mean-squared-error loss: the input
    (for the first weight's gradient), each hidden layer's tanh output (tanh's backward needs it,
    and it is the next Linear's input), and the output and target (the loss's backward)."""
    return e * rows * (widths[0] + sum(widths[1:-1]) + 2 * widths[-1])
