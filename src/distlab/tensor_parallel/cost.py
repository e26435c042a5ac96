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
    inside the parallel layers:  inside   = N seq (4d + 2 d_ff) + N h seq    q, k, v, the heads' output,
                                             fc1's output and GELU's, softmax's log-sum-exp per head and row

    tensor parallel:   region + gathered + inside / P      sequence parallel:   (region + inside) / P + gathered

(Megatron-LM also keeps `gathered` cut, saving each rank's part and all-gathering it again in backward.)
"""

from __future__ import annotations

from fractions import Fraction

from distlab.comm.collectives import ring_fraction
from distlab.tensor_parallel.model import BlockConfig

PARTS_IN = {"mlp": 1, "attention": 1, "block": 2}  # (enter, exit) pairs per forward


def expected_traffic(
    cfg: BlockConfig, part: str, world_size: int, sequence_parallel: bool, steps: int = 1
) -> dict[tuple[str, str], Fraction]:
    """Bytes this rank sends, by (direction, collective), in `steps` steps of `part`: exact fractions, whole
    numbers wherever P cuts the tensors evenly (what a `Ledger` of the run counts)."""
    e = cfg.dtype.itemsize
    act = Fraction(cfg.batch * cfg.seq * cfg.dim * e) * PARTS_IN[part] * steps
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
    out["gradients", "all_reduce"] = frac["all_reduce"] * cut * cfg.dim * e * steps
    return out


def activation_terms(cfg: BlockConfig) -> tuple[int, int, int]:
    """(region, gathered, inside) of the docstring, in elements."""
    tokens = cfg.batch * cfg.seq
    return tokens * (2 * cfg.dim + 4), 2 * tokens * cfg.dim, tokens * (4 * cfg.dim + 2 * cfg.ffn + cfg.heads)


def activation_bytes(cfg: BlockConfig, world_size: int, sequence_parallel: bool) -> Fraction:
    region, gathered, split = activation_terms(cfg)
    region_part = Fraction(region, world_size) if sequence_parallel else region
    return (region_part + gathered + Fraction(split, world_size)) * cfg.dtype.itemsize
