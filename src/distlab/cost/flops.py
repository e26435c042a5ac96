"""The FLOPs of a step, per rank: forward, backward, recomputation; and the model's FLOPs, which MFU divides by.

A product of an (m x k) and a (k x n) matrix costs 2 m k n FLOPs (a multiply and an add per term), and the
matrix products are all that is counted: the rule of `torch.utils.flop_counter.FlopCounterMode`, which the
tests and lesson 13 hold these formulas to, exactly, for the block stack at several shapes. On T = rows x seq
tokens, one block's forward costs

    2 T (d d + 2 d d_kv + d d)        q, k, v, out projections (d_kv = d with as many key/value heads as heads)
    + 2 T d d_ff x (2, or 3 gated)    the MLP
    + 4 rows seq^2 d                  q k^T and omega v, every head: counted whole, masked or not

(causal attention computes about half of its seq^2 products in a kernel that skips the masked tiles; the
count, like FlopCounterMode's for torch's fused kernels and PaLM's MFU formula, is the whole square). A
vocabulary adds 2 T d vocab for the head (the embedding is a lookup: no product). Split over the ranks:
tensor parallelism cuts every product by tp (heads and d_ff, lesson 08); context parallelism leaves a rank
seq / cp queries against all seq keys (lesson 09: zig-zag, equal work per rank); a pipeline rank runs its
stages' layers (lesson 02), the head on the last stage; data parallelism a rank's N / dp rows.

Backward computes two products per forward product (the input's gradient and the weight's), so twice the
forward, except where the input needs no gradient: the layered MLP's first Linear (its input is data) skips
dX, 2 rows w_0 w_1. Recomputation (`torch.utils.checkpoint` around every block, non-reentrant) reruns each
block's forward in backward, but stops as soon as every saved tensor is back: the block's last product,
fc2, whose output nothing saved, is not rerun (torch's early stop). The model's FLOPs, the numerator of MFU,
are forward + backward of the global batch with no recomputation (recomputation is work the hardware does,
not work the model needs: counting it gives the hardware FLOPs utilisation, HFU).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from distlab.cost.inputs import Batch, Mlp, Parallel, lasts, stage_layers
from distlab.cost.schedule import passes, stages
from distlab.proof.sizes import Transformer

LOOKUPS = ("embed.weight",)  # matrices a forward indexes, never multiplies
UP_PROJECTIONS = ("attn.q.weight", "attn.kv_up.weight")  # MLA's q and k, v from their latents


@dataclass(frozen=True)
class Flops:
    """FLOPs of one rank (or of the whole step): forward, backward, and the forward rerun in backward."""

    forward: int = 0
    backward: int = 0
    recompute: int = 0

    @property
    def model(self) -> int:
        """What the model needs: forward and backward."""
        return self.forward + self.backward

    @property
    def hardware(self) -> int:
        """What the hardware computes: recomputation too."""
        return self.model + self.recompute

    def __add__(self, other: Flops) -> Flops:
        return Flops(self.forward + other.forward, self.backward + other.backward, self.recompute + other.recompute)

    def times(self, k: int) -> Flops:
        return Flops(k * self.forward, k * self.backward, k * self.recompute)


def attention_forward(model: Transformer, rows: int, seq: int, tp: int = 1, cp: int = 1) -> int:
    """q k^T and omega v for rows sequences, seq / cp queries per rank against all seq keys, h / tp heads:
    2 rows (seq / cp) seq h (d_qk + d_h) / tp, which is 4 rows seq^2 d when d_qk = d_h = d / h."""
    per_head = model.qk_dim + model.head_dim
    return 2 * rows * (seq // cp) * seq * model.heads * per_head // tp


def products_forward(weights, tokens: int, tp: int = 1, top_k: int = 0) -> int:
    """2 x tokens x (the elements of every matrix a rank multiplies a token by): its Linears' products (a
    routed expert's: top_k of them per token; with balanced routing every rank gets as many token-expert
    pairs as its own tokens chose, whatever ep)."""
    return sum(2 * tokens * w.per_token(tp, top_k) for w in weights if w.cols > 1 and w.name not in LOOKUPS)


@cache
def block_forward(model: Transformer, rows: int, seq: int, tp: int = 1, cp: int = 1, moe: bool = False) -> int:
    """One block's forward on one rank: its projections and MLP on rows x seq / cp tokens, and attention."""
    tokens = rows * (seq // cp)
    products = products_forward(model.block_weights(moe), tokens, tp, model.top_k)
    return products + attention_forward(model, rows, seq, tp, cp)


@cache
def last_product(model: Transformer, rows: int, seq: int, tp: int = 1, cp: int = 1, moe: bool = False) -> int:
    """fc2's forward in one block: what torch's checkpoint does not rerun (nothing saved its output)."""
    fc2 = [w for w in model.block_weights(moe) if w.name.endswith("fc2.weight")]
    return products_forward(fc2, rows * (seq // cp), tp, model.top_k)


def stage_flops(model: Transformer | Mlp, batch: Batch, parallel: Parallel, stage: int) -> Flops:
    """One micro-batch (N / (dp M) rows) through pipeline stage `stage` (of pp v) on one of its ranks."""
    rows = batch.global_batch // (parallel.dp * batch.micro_batches)
    layers = stage_layers(model, parallel)[stage]
    if isinstance(model, Mlp):
        units = model.units()
        forward = sum(products_forward(units[i], rows) for i in layers)
        skipped = 2 * rows * model.widths[0] * model.widths[1] if 0 in layers else 0  # the data needs no dX
        return Flops(forward, 2 * forward - skipped)
    tp, cp, forward, rerun = parallel.tp, parallel.cp, 0, 0
    for layer in layers:
        block = block_forward(model, rows, batch.seq, tp, cp, model.is_moe(layer))
        forward += block
        rerun += block - last_product(model, rows, batch.seq, tp, cp, model.is_moe(layer))
    if model.vocab and stage in lasts(parallel):
        forward += products_forward([model.head_matrix()], rows * (batch.seq // cp), tp)  # tied or not
    if parallel.selective:  # Megatron's selective: attention's core alone rerun, every block
        rerun = len(layers) * attention_forward(model, rows, batch.seq, tp, cp)
    rerun = rerun if parallel.recompute or parallel.selective else 0
    if "recompute-norm-up" in parallel.measures and model.mla and not parallel.recompute:
        # DeepSeek-V3 reruns MLA's up-projections in backward (its RMSNorms too, but a norm is no product)
        up = [w for w in model.block_weights() if w.name in UP_PROJECTIONS]
        rerun += len(layers) * products_forward(up, rows * (batch.seq // cp), tp)
    return Flops(forward, 2 * forward, rerun)


def rank_flops(model: Transformer | Mlp, batch: Batch, parallel: Parallel, pp_rank: int = 0) -> Flops:
    """A step on one rank of pipeline position `pp_rank`: M micro-batches through each stage it holds
    (`distlab.model_split.schedules.placement`: looped r, r + P, ..; the V-shaped schedules r and 2P - 1 - r)."""
    total = Flops()
    for stage in stages(parallel, batch, pp_rank):  # M micro-batches each (DualPipe: M / 2, `passes`)
        total = total + stage_flops(model, batch, parallel, stage).times(passes(parallel, batch))
    return total


def model_flops(model: Transformer | Mlp, batch: Batch) -> int:
    """The step's useful FLOPs, all ranks together: forward and backward of the global batch, on one rank
    with no split and no recomputation (the same whatever the split: MFU's numerator)."""
    return stage_flops(model, Batch(batch.global_batch, batch.seq), Parallel(), 0).model
