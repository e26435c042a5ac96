"""Bytes one rank sends in a step, by (mesh dimension, collective), and how many calls carry them.

Each dimension's count is the formula its lesson proves against a ledger of real ranks (ring accounting,
`distlab.comm.collectives`: an all-reduce sends 2 (P-1)/P of the tensor, a gather or a scatter (P-1)/P):

- dp (lesson 07, `distlab.data_split.sharding.accounting.expected_bytes`, on the rank's own units at e bytes, bf16
  gradients under mixed precision): DDP's all-reduce 2 (P-1) e Psi_P; ZeRO-1 and -2 a reduce-scatter and an
  all-gather, the same; ZeRO-3 two all-gathers and a reduce-scatter, less g_0 where the first unit's
  backward never reads its weights (the layered MLP's first Linear, an embedding). Lesson 07 runs one
  micro-batch; with M, gradients accumulate whole under DDP and ZeRO-1 (one reduction per step), ZeRO-2
  reduce-scatters every micro-batch (it keeps only a shard), ZeRO-3 gathers and reduce-scatters every one;
- tp (lesson 08, `distlab.layer_split.tensor_parallel.cost.expected_traffic` of one block on a micro-batch of N / (dp M)
  rows and seq / cp tokens): 2 (P-1)/P N seq d e each way per block, or its all-gather / reduce-scatter
  halves with sequence parallelism (plus the 6 d-vectors' gradients, once per step); recomputation runs the
  forward's collectives again, and `cut_gathered` (Megatron-LM) gathers q, k, v's and fc1's input again in
  backward. A vocabulary adds the planner's estimate of the embedding's and the head's
  two all-reduces of a micro-batch's T d (no lesson runs them);
- cp (lesson 09, `distlab.layer_split.context_parallel.cost.Sizes.expected_bytes`): per attention, 2 (P-1) k/v blocks
  forward and 4P - 2 backward, a block h/tp x seq/cp x d_h per sequence (grouped-query attention: kv_heads);
- ep (lesson 10, `distlab.layer_split.expert_parallel.cost.expected_bytes` on a balanced routing matrix): per
  mixture-of-experts layer and micro-batch, dispatch and combine forward and backward, (ep - 1) / ep of the
  rank's T top_k routed rows of d e each way; the routed experts' gradients reduce over dp / ep ranks;
- pp (lessons 01-03, `distlab.model_split.p2p.comm_plan`): every micro-batch's activation to the next stage and
  its gradient back, one micro-batch's N / (dp M) x seq / cp x d e (a layered MLP's width at the cut),
  where the next stage lives on another rank (the turn of a V does not).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from distlab.comm.collectives import ring_fraction
from distlab.cost.inputs import PRECISIONS, Batch, Mlp, Parallel, ceil_div, firsts, stage_layers
from distlab.cost.memory import DTYPE_OF, rank_units, sizes
from distlab.cost.schedule import owner, passes, stages
from distlab.data_split.sharding import accounting
from distlab.layer_split.context_parallel.cost import Sizes as RingSizes
from distlab.layer_split.expert_parallel.cost import expected_bytes
from distlab.layer_split.tensor_parallel.cost import expected_traffic
from distlab.layer_split.tensor_parallel.model import BlockConfig
from distlab.proof.sizes import Transformer


@dataclass
class Traffic:
    """sent[(dimension, collective)]: bytes; calls[(dimension, collective)]: collectives (or messages)."""

    sent: Counter = field(default_factory=Counter)
    calls: Counter = field(default_factory=Counter)

    def add(self, key: tuple[str, str], nbytes: int, calls: int) -> None:
        if nbytes:
            self.sent[key] += int(nbytes)
            self.calls[key] += calls

    def by_dimension(self) -> dict[str, int]:
        out: Counter = Counter()
        for (dim, _), n in self.sent.items():
            out[dim] += n
        return dict(out)

    @property
    def total(self) -> int:
        return sum(self.sent.values())


def _micro_rows(batch: Batch, parallel: Parallel) -> int:
    return batch.global_batch // (parallel.dp * batch.micro_batches)


def data_parallel(
    traffic: Traffic, model, batch: Batch, parallel: Parallel, precision: str, pp_rank: int, experts: bool = False
) -> None:
    """Lesson 07's bytes on this rank's units (see the module docstring for M > 1); `experts`: the routed
    experts' units, over the dp / ep ranks that hold the same experts. Float32 gradients
    (`parallel.grad_bytes` 4) reduce at 4 bytes; the weights gather at e."""
    dp = parallel.dp // parallel.ep if experts else parallel.dp
    units, m = rank_units(model, parallel, pp_rank, batch, experts), batch.micro_batches
    if dp == 1 or not units:
        return
    e = PRECISIONS[precision].e
    s = sizes(units, dp, e)
    holds_first = any(s in firsts(parallel) for s in stages(parallel, batch, pp_rank))
    needs_no_weights = isinstance(model, Mlp) or bool(getattr(model, "vocab", 0))  # data in; an embedding
    first = ceil_div(units[0][0], dp) if holds_first and needs_no_weights and not experts else 0
    one_pass = accounting.expected_bytes("ZeRO-1", s) // 2  # one reduce-scatter (or all-gather) of every unit
    grads = (parallel.grad_bytes or e) / e  # a gradient's bytes against a weight's
    stage, n = parallel.zero, len(units)
    if stage == "DDP":
        traffic.add(("dp", "all_reduce"), grads * accounting.expected_bytes(stage, s), n)
    elif stage in ("ZeRO-1", "ZeRO-2"):
        scatters = m if stage == "ZeRO-2" else 1
        traffic.add(("dp", "reduce_scatter"), grads * scatters * one_pass, scatters * n)
        traffic.add(("dp", "all_gather"), one_pass, n)
    else:
        gathers = accounting.expected_bytes(stage, s, first) - one_pass  # forward's and backward's
        traffic.add(("dp", "reduce_scatter"), grads * m * one_pass, m * n)
        traffic.add(("dp", "all_gather"), m * gathers, m * (2 * n - (1 if first else 0)))


def expert_parallel(traffic: Traffic, model: Transformer, batch: Batch, parallel: Parallel, e: int, layers: int):
    """Lesson 10's bytes (`distlab.layer_split.expert_parallel.cost.expected_bytes`) for every mixture-of-experts layer
    and micro-batch, with balanced routing: each of a rank's T tokens sends its top_k copies, E / ep experts
    to an owner, so the routing matrix between the ep ranks is T k / ep everywhere. Dispatch and combine
    forward, their mirrors backward; recomputation runs the forward's again. The counts' all-gather is
    left out (E int64 numbers, nothing beside a step's rows)."""
    tokens = _micro_rows(batch, parallel) * (batch.seq // parallel.cp)
    kept = torch.full((parallel.ep, model.experts), tokens * model.top_k, dtype=torch.int64)  # E x the real count
    phases = {k: v for k, v in expected_bytes(kept, 0, model.dim * e).items() if k != "counts"}
    forwards = passes(parallel, batch) * layers * (2 if parallel.recompute else 1)
    backwards = passes(parallel, batch) * layers
    for phase, nbytes in phases.items():
        runs = backwards if "backward" in phase else forwards
        traffic.add(("ep", "all_to_all"), runs * nbytes // model.experts, runs)


def tensor_parallel(traffic: Traffic, model: Transformer, batch: Batch, parallel: Parallel, e: int, blocks: int):
    """Lesson 08's bytes for `blocks` blocks, M micro-batches (recomputation: the forward's again)."""
    rows, seq = _micro_rows(batch, parallel), batch.seq // parallel.cp
    cfg = BlockConfig(model.one_block(), rows, seq, dropout=0.0, dtype=DTYPE_OF[e])
    m = passes(parallel, batch)
    runs = {"forward": m * (2 if parallel.recompute else 1), "backward": m}
    for (phase, kind), nbytes in expected_traffic(cfg, "block", parallel.tp, parallel.sp).items():
        if phase in runs:  # attention's and the MLP's, every block, every micro-batch
            traffic.add(("tp", kind), runs[phase] * blocks * nbytes, runs[phase] * blocks * 2)
        else:  # "gradients": every block's d-vectors in one message, once per step
            traffic.add(("tp", kind), blocks * nbytes, 1)
    if parallel.cut_gathered:  # Megatron-LM's: the inputs of q, k, v and fc1 gathered again in backward
        again = 2 * ring_fraction("all_gather", parallel.tp) * rows * seq * model.dim * e
        traffic.add(("tp", "all_gather"), m * blocks * again, 2 * m * blocks)
    if model.vocab:  # the planner's estimate: the embedding's and the head's all-reduce of T d
        est = expected_traffic(cfg, "mlp", parallel.tp, False)[("forward", "all_reduce")]
        traffic.add(("tp", "all_reduce"), 2 * m * est, 2 * m)


def context_parallel(traffic: Traffic, model: Transformer, batch: Batch, parallel: Parallel, e: int, blocks: int):
    """Lesson 09's ring bytes per attention, for every sequence, block and micro-batch."""
    heads = (model.kv_heads or model.heads) // parallel.tp
    forward, backward = RingSizes(heads, batch.seq, model.head_dim, parallel.cp, e).expected_bytes()
    rows, m, cp = _micro_rows(batch, parallel), passes(parallel, batch), parallel.cp
    forwards, backwards = m * blocks * (2 if parallel.recompute else 1), m * blocks
    messages = forwards * 2 * (cp - 1) + backwards * (4 * cp - 2)  # one k/v (or dk/dv) block each
    traffic.add(("cp", "ring"), rows * (forwards * forward + backwards * backward), messages)


def boundary_bytes(model, batch: Batch, parallel: Parallel, e: int, stage: int) -> int:
    """One micro-batch's activation leaving stage `stage` (and its gradient, coming back)."""
    rows = _micro_rows(batch, parallel)
    if isinstance(model, Mlp):
        return e * rows * model.widths[stage_layers(model, parallel)[stage].stop]
    return e * rows * (batch.seq // parallel.cp) * model.dim // (parallel.tp if parallel.sp else 1)


def pipeline(traffic: Traffic, model, batch: Batch, parallel: Parallel, e: int, pp_rank: int) -> None:
    """Activations forward and gradients back across the cuts that leave this rank (lessons 01-03). DualPipe's
    copies end at stage P - 1 and begin at stage P (no message between them), and each rank sends its mirror its
    two chunks' gradients once a step, which the mirror adds to its own (lesson 19's sum of the copies)."""
    where, last, m = owner(parallel, batch), parallel.pp * parallel.stages_per_rank - 1, passes(parallel, batch)
    for stage in stages(parallel, batch, pp_rank):
        if stage < last and where[stage + 1] != pp_rank:
            traffic.add(("pp", "send"), m * boundary_bytes(model, batch, parallel, e, stage), m)
        if stage > 0 and where[stage - 1] != pp_rank:
            traffic.add(("pp", "send"), m * boundary_bytes(model, batch, parallel, e, stage - 1), m)
    if parallel.schedule == "dualpipe":
        units = rank_units(model, parallel, pp_rank, batch) + rank_units(model, parallel, pp_rank, batch, True)
        traffic.add(("pp", "send"), (parallel.grad_bytes or e) * sum(n for n, _ in units), 1)


def per_rank(model, batch: Batch, parallel: Parallel, precision: str, pp_rank: int = 0) -> Traffic:
    """Every byte one rank of pipeline position `pp_rank` sends in a step."""
    traffic, e = Traffic(), PRECISIONS[precision].e
    if parallel.dp > 1:
        data_parallel(traffic, model, batch, parallel, precision, pp_rank)
        if getattr(model, "experts", 0):
            data_parallel(traffic, model, batch, parallel, precision, pp_rank, experts=True)
    mine = [i for s in stages(parallel, batch, pp_rank) for i in stage_layers(model, parallel)[s]]
    blocks = len(mine)
    if parallel.ep > 1:
        expert_parallel(traffic, model, batch, parallel, e, sum(model.is_moe(i) for i in mine))
    if isinstance(model, Transformer) and parallel.tp > 1:
        tensor_parallel(traffic, model, batch, parallel, e, blocks)
    if isinstance(model, Transformer) and parallel.cp > 1:
        context_parallel(traffic, model, batch, parallel, e, blocks)
    if parallel.pp > 1:
        pipeline(traffic, model, batch, parallel, e, pp_rank)
    return traffic
