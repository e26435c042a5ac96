"""What one rank of the mesh sends and holds per step, in closed form: lessons 07-09's formulas, composed.
A block's activations and tensor-parallel bytes are lesson 08's (`distlab.layer_split.tensor_parallel.cost`),
the ring's bytes lesson 09's (`distlab.layer_split.context_parallel.cost`), FSDP2's padded shards lesson 07's
(`distlab.data_split.sharding.fsdp.fsdp_states`), and the parameters and how tensor parallelism cuts each the
size record's (`distlab.proof.sizes.Transformer`): imported, not derived again (the composed mesh stands on
the top floor beside the cost model, tests/test_layering.py). What is new here is the mesh around them: the
embedding and head's collectives, the stage's units, torch's pipeline stage's receive buffers.

Notation: a shape dp x pp x tp x cp; W = dp cp the ranks FSDP2 shards over; a rank on pipeline stage p holds
L_p = L / pp blocks. One micro-batch on a rank: n = N / (dp M) sequences of s = seq / cp positions; e bytes
an element; a = n s d e its activation (all of its cp rank's positions); r_x = (x - 1) / x.

Bytes sent per step (ring accounting, `distlab.comm.collectives`), by dimension:

    pp  forward: M n (s / tp) d e, the activation into stage p + 1 (not on the last stage); backward: the
        same, its gradient back to stage p - 1 (not on the first). Sequence parallelism cuts it by tp.
    tp  (lesson 08, sequence parallel) per micro-batch and block: all-gather before attention and before the
        MLP, reduce-scatter after each, r_tp a each; backward the reverse. The embedding's output is
        reduce-scattered (partial sums over the vocabulary's rows; backward all-gathered), the head's input
        all-gathered (backward reduce-scattered) and its logits all-gathered, r_tp n s V e. After the last
        backward the LayerNorms' gains and biases (partial sums over the positions) are all-reduced: 2 r_tp d e
        each, 4 a block and 2 for the final norm.
    cp  (lesson 09) per micro-batch and block: the ring's k and v blocks, 2 (cp - 1) forward, 2 (cp - 1) + 2 cp
        backward (with dk, dv), a block n (h / tp) s d_h e.
    dp x cp  (lesson 07, FSDP2 with reshard_after_forward=False) per step and unit (a block; the stage's
        embedding, norm and head): one all-gather before its first forward, one reduce-scatter after the
        last backward, each (W - 1) e sum_params ceil(rows / W) cols: a parameter's rows (of this tp rank's
        piece) padded to a multiple of W.

Model states per rank (lesson 07's FSDP2, `fsdp_states`, on this tp rank's pieces): weights and gradients
e sum ceil(rows / W) cols (padded); AdamW's two moments 2 e sum (this shard's real rows) cols; a 4-byte step
count per parameter.

Activations (lesson 08's terms with N seq -> n s, each block sequence parallel; lesson 09's ring saves what
torch's attention saves: q, k, v, out and a log-sum-exp per head and row). Per micro-batch and block

    region / tp + gathered + inside / tp,   region = n s (2 d + 4), gathered = 2 n s d,
                                            inside = n s (4 d + 2 d_ff) + n h s

(elements, times e); on the first stage the token ids (int64) of the rank's whole share, (N / dp) s (the
micro-batches are views of it); on the last the final norm's input and statistics n s (d + 2) / tp, the head's
gathered input n s d, the loss's log-softmax n s V and the targets' ids (N / dp) s, and one 8-byte scalar.
1F1B keeps min(M, pp - p) micro-batches in flight on stage p (lesson 03): the peak is that many times a
micro-batch's, the ids' storages once, and one more thing torch's stage keeps: on every stage after the first,
a micro-batch's activation arrives in a receive buffer of its own that the stage allocates at its first step
and reuses every step, and the stage's first LayerNorm saves that buffer as its input; after the micro-batch's
backward the buffer stays. At the step's last forward all M buffers are alive, n (s / tp) d e each:

    peak = min(M, pp - p) micro-batch + (M - min(M, pp - p)) n (s / tp) d e (p > 0) + the ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from distlab.comm.collectives import ring_fraction
from distlab.composed.config import RunConfig
from distlab.composed.dims import ParallelDims
from distlab.data_split.sharding.fsdp import fsdp_states
from distlab.layer_split.context_parallel.cost import Sizes as RingSizes
from distlab.layer_split.tensor_parallel.cost import activation_bytes, expected_traffic
from distlab.layer_split.tensor_parallel.model import BlockConfig

IDS = 8  # bytes of an int64 token id


@dataclass(frozen=True)
class Place:
    """Where a rank sits: its pipeline stage and its index among the W = dp cp ranks FSDP2 shards over."""

    stage: int
    shard: int


def stage_units(cfg: RunConfig, shape: ParallelDims, stage: int) -> list[list[tuple[int, int]]]:
    """FSDP2's units on a stage, each the (rows, cols) of this tp rank's piece of every parameter: its blocks,
    then the rest (the root's own: the embedding on the first stage, the final norm and the head on the last).
    The parameters and how tensor parallelism cuts each are the size record's (`Transformer.block_weights`)."""
    model, per = cfg.model, cfg.model.layers // shape.pp
    blocks = [model.layer_weights(i) for i in range(stage * per, (stage + 1) * per)]
    root = [model.embedding()] if stage == 0 else []
    root += model.head_weights() if stage == shape.pp - 1 else []
    return [[w.piece(shape.tp) for w in unit] for unit in blocks + ([root] if root else [])]


def _block(cfg: RunConfig, n: int, s: int) -> BlockConfig:
    """Lesson 08's sizes of one block on a micro-batch of n sequences of s positions."""
    return BlockConfig(cfg.model.one_block(), n, s, dropout=0.0, dtype=cfg.dtype)


def expected_sent(cfg: RunConfig, shape: ParallelDims, place: Place) -> dict[tuple[str, str, str], Fraction]:
    """Bytes this rank sends in one step, by (dimension, phase, collective); zero entries left out."""
    e, m, first, last = cfg.dtype.itemsize, cfg.micro_batches, place.stage == 0, place.stage == shape.pp - 1
    n, s, per, tp = cfg.batch // (shape.dp * m), cfg.seq // shape.cp, cfg.model.layers // shape.pp, shape.tp
    act, out = n * s * cfg.model.dim * e, {}
    out["pp", "forward", "send"] = 0 if last else m * act // tp
    out["pp", "backward", "send"] = 0 if first else m * act // tp
    # lesson 08's bytes per block (`expected_traffic`, sequence parallel), and the same collectives around
    # the embedding (first stage) and the head (last stage), one activation each, r a
    blocks = expected_traffic(_block(cfg, n, s), "block", tp, True, per)
    r = ring_fraction("all_gather", tp)  # = reduce-scatter's
    out["tp", "forward", "all_gather"] = m * (
        blocks["forward", "all_gather"] + r * last * (act + n * s * cfg.model.vocab * e)
    )
    out["tp", "forward", "reduce_scatter"] = m * (blocks["forward", "reduce_scatter"] + r * first * act)
    out["tp", "backward", "all_gather"] = m * (blocks["backward", "all_gather"] + r * first * act)
    out["tp", "backward", "reduce_scatter"] = m * (blocks["backward", "reduce_scatter"] + r * last * act)
    out["tp", "gradients", "all_reduce"] = ring_fraction("all_reduce", tp) * (4 * per + 2 * last) * cfg.model.dim * e
    # lesson 09's ring (`Sizes.expected_bytes`), per sequence, every block, every micro-batch
    ring_forward, ring_backward = RingSizes(
        cfg.model.heads // tp, cfg.seq, cfg.model.head_dim, shape.cp, e
    ).expected_bytes()
    out["cp", "forward", "send"] = m * per * n * ring_forward
    out["cp", "backward", "send"] = m * per * n * ring_backward
    # lesson 07's FSDP2: every unit gathered once and its gradient reduce-scattered once, (W - 1) padded shards each
    shard = expected_states(cfg, shape, place)["weights"]
    out["dp_cp", "forward", "all_gather"] = out["dp_cp", "gradients", "reduce_scatter"] = (shape.shards - 1) * shard
    return {key: Fraction(v) for key, v in out.items() if v}


def expected_states(cfg: RunConfig, shape: ParallelDims, place: Place) -> dict[str, int]:
    """Bytes of each model-state item on this rank after a step: lesson 07's FSDP2 (`fsdp_states`) over the
    W = dp cp ranks, on this tp rank's pieces of the stage's parameters."""
    params = [piece for unit in stage_units(cfg, shape, place.stage) for piece in unit]
    return fsdp_states(params, shape.shards, place.shard, cfg.dtype.itemsize)


def in_flight(cfg: RunConfig, shape: ParallelDims, stage: int) -> int:
    """Micro-batches whose activations stage `stage` holds at once under 1F1B: min(M, pp - p)."""
    return min(cfg.micro_batches, shape.pp - stage)


def expected_activations(cfg: RunConfig, shape: ParallelDims, stage: int) -> tuple[int, int]:
    """(bytes one micro-batch saves on this stage, the peak over the step), by the module docstring: a block's
    is lesson 08's sequence-parallel count (`activation_bytes`) on n sequences of s positions."""
    e, tp, d = cfg.dtype.itemsize, shape.tp, cfg.model.dim
    n, s, per = cfg.batch // (shape.dp * cfg.micro_batches), cfg.seq // shape.cp, cfg.model.layers // shape.pp
    layer = activation_bytes(_block(cfg, n, s), tp, True)
    ids = (cfg.batch // shape.dp) * s * IDS  # one storage for the rank's whole share of the step
    shared, own = 0, per * layer
    if stage == 0:
        shared += ids
    if stage == shape.pp - 1:
        shared += ids  # the targets
        own += (Fraction(n * s * (d + 2), tp) + n * s * d + n * s * cfg.model.vocab) * e + 8
    held = in_flight(cfg, shape, stage)
    buffers = 0 if stage == 0 else (cfg.micro_batches - held) * n * (s // tp) * d * e  # done, still held
    return int(own + shared), int(held * own + buffers + shared)
