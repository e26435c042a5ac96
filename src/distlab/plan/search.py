"""Which splits of a model over a cluster fit in memory, and which is fastest.

The configurations tried, for G GPUs, g to a node, N sequences of seq tokens: the planner's choices below,
each shape kept only if the shape's one validation lets it run (`ParallelDims.check`, the rules lesson 12's
flags and the cost model's `check` ask: tp divides the heads, the key/value heads, d_ff, the vocabulary and a
cp rank's positions, cp cuts seq into 2 cp pieces, dp divides N, pp stages of a layer at least):

    tp   a power of two up to g (inside a node); with sequence parallelism as Megatron-LM runs it (the gathered
         inputs kept cut)
    cp   1, or a power of two leaving every rank at least `MIN_CP_TOKENS` tokens of each sequence
    pp   a divisor of G / (tp cp); 1F1B, and interleaved 1F1B (v = 2, 4) where it applies
    dp   G / (tp cp pp)
    ep   (a mixture of experts) the largest power of two dividing dp and the experts, at most `MAX_EP`
    b    sequences per micro-batch, 1, 2, 4, 8 or 16 (M = N / (dp b) micro-batches, at least pp)
    then the first that fits, in this order, of ZeRO-1, -2, -3 (dp > 1; DDP holds more than ZeRO-1 and sends
    the same), each without, then with the MLP's activation function rebuilt (act-fn), then with full activation
    recomputation: the first that fits is the cheapest.

A strategy the user fixes (`Choices`: the planner's --zero, --recompute, --micro-batch, --schedule,
--stages-per-rank, --grad-dtype, --sp, --measures) narrows the search to it: only that ZeRO stage (and so only dp > 1
for ZeRO-1..3), that recomputation, that many sequences a micro-batch, that schedule; never silently dropped.

A configuration fits when every rank's predicted bytes (`distlab.cost.step`: model states, activations at
the schedule's peak, the planner's transient buffers) and the reserve are at most the device's memory
(`budget`). A configuration given whole (`--layout`) is priced by `price`, fitting or not. The fitting ones are
ranked by predicted step time (`distlab.cost.timing.predict`), fastest first; MFU ranks them the same way
(the model's FLOPs and P are the same for all).
"""

from __future__ import annotations

from dataclasses import dataclass

from distlab.composed.dims import ParallelDims
from distlab.cost import memory
from distlab.cost.inputs import Batch, Parallel
from distlab.cost.rules import check
from distlab.cost.step import StepCost, step_cost
from distlab.cost.timing import Assumptions, StepTime, predict
from distlab.proof.hardware import DEFAULT_RESERVE_GIB, GIB, Cluster
from distlab.proof.sizes import Transformer

MICRO_BATCH_ROWS = (1, 2, 4, 8, 16)
MIN_CP_TOKENS = 4096
STAGES = ("ZeRO-1", "ZeRO-2", "ZeRO-3")
# what a block rebuilds in backward, by the planner's --recompute names: cheapest first. "selective" is
# Megatron-LM's (Korthikanti et al.: attention's core, q k^T, softmax, dropout, omega v); "act-fn" the MLP's
# activation function alone; "full" every block (torch.utils.checkpoint)
RECOMPUTE = {
    "none": dict(),
    "selective": dict(selective=True),
    "act-fn": dict(act_fn=True),
    "full": dict(recompute=True),
}
DEPTHS = {"1f1b": (1,), "zb-h1": (1,), "interleaved-1f1b": (2, 4), "interleaved-zb": (2, 4)}  # v tried
DEPTHS |= {"dualpipev": (2,), "dualpipe": (2,)}  # a V: two stages a rank (distlab.cost.schedule)
SEARCHED = ("none", "act-fn", "full")  # Megatron's selective saves nothing beside a fused attention kernel
MAX_EP = 64


@dataclass(frozen=True)
class Choices:
    """The strategy the search may choose from, narrowed by what the user fixed (None: the search chooses)."""

    precision: str = "bf16"
    zero: str | None = None  # "DDP" or "ZeRO-1".."ZeRO-3"
    recompute: str | None = None  # a name of RECOMPUTE
    micro_batch: int | None = None  # sequences per micro-batch, b
    schedule: str | None = None  # a name of distlab.model_split.schedules.SCHEDULES
    stages_per_rank: int | None = None  # v
    grad_bytes: int = 0  # 4: float32 gradients
    sp: bool = True  # sequence parallelism beside tp (Megatron-LM's, the gathered inputs kept cut)
    measures: tuple[str, ...] = ()  # DeepSeek-V3's memory measures taken (`distlab.cost.inputs.MEASURES`)

    def strategy(self, tp: int) -> dict:
        """The Parallel fields every configuration of this search shares."""
        sp = dict(sp=True, cut_gathered=True) if tp > 1 and self.sp else {}
        return dict(grad_bytes=self.grad_bytes, measures=self.measures, **sp)


@dataclass(frozen=True)
class Candidate:
    cost: StepCost
    time: StepTime

    @property
    def parallel(self) -> Parallel:
        return self.cost.parallel

    @property
    def memory(self) -> int:
        return self.cost.peak_held


def _powers_of_two(limit: int) -> list[int]:
    return [2**k for k in range(limit.bit_length()) if 2**k <= limit]


def layouts(model: Transformer, batch: Batch, gpus: int, gpus_per_node: int, sp: bool = True):
    """Every shape of P = `gpus` the search tries: the planner's choices (tp a power of two inside a node, cp a
    power of two leaving `MIN_CP_TOKENS` tokens a rank, pp any divisor), of which it keeps those the shape's
    one validation (`ParallelDims.check`, sequence parallel as the search runs it) lets run."""
    for tp in _powers_of_two(min(gpus_per_node, gpus)):
        for cp in _powers_of_two(gpus // tp):
            if cp > 1 and batch.seq // cp < MIN_CP_TOKENS:
                continue
            rest = gpus // (tp * cp)
            for pp in (p for p in range(1, rest + 1) if rest % p == 0):
                dims = ParallelDims(dp=rest // pp, pp=pp, tp=tp, cp=cp)
                try:
                    dims.check(model, batch.global_batch, batch.seq, sequence_parallel=sp)
                except ValueError:
                    continue
                yield dims


def splits(model: Transformer, batch: Batch, gpus: int, gpus_per_node: int, choices: Choices = Choices()):
    """Every (tp, cp, pp, dp, M, schedule, v) the search tries (module docstring), narrowed by `choices`."""
    for dims in layouts(model, batch, gpus, gpus_per_node, choices.sp):
        if choices.zero not in (None, "DDP") and dims.dp == 1:
            continue  # a ZeRO stage shards over dp ranks: none to shard over
        yield from _schedules(model, batch, dims, choices)


def expert_ranks(model: Transformer, dp: int) -> int:
    """ep for a mixture of experts: the largest power of two dividing dp and the experts, at most MAX_EP."""
    ep = 1
    while getattr(model, "experts", 0) and ep * 2 <= MAX_EP and dp % (ep * 2) == 0 and model.experts % (ep * 2) == 0:
        ep *= 2
    return ep


def _schedules(model: Transformer, batch: Batch, dims: ParallelDims, choices: Choices):
    tp, cp, pp, dp = dims.tp, dims.cp, dims.pp, dims.dp
    rows = batch.global_batch // dp
    sizes = MICRO_BATCH_ROWS if choices.micro_batch is None else (choices.micro_batch,)
    for b in (b for b in sizes if rows % b == 0):
        m = rows // b
        if m < pp:
            continue
        for schedule in (choices.schedule,) if choices.schedule else ("1f1b", "interleaved-1f1b"):
            for v in (choices.stages_per_rank,) if choices.stages_per_rank else DEPTHS[schedule]:
                if v == 1 or pp > 1 and m % pp == 0 and model.layers >= v * pp:
                    yield tp, cp, pp, dp, m, schedule, v


def likely_peak(model, batch: Batch, parallel: Parallel, precision: str) -> int:
    """What the first and the last pipeline rank hold, by `distlab.cost.memory` alone: the quick test. The
    first holds the most micro-batches and the embedding, the last the logits; `search` checks every rank."""
    ranks = {0, parallel.pp - 1}
    return max(sum(memory.per_rank(model, batch, parallel, precision, r, "cuda").values()) for r in ranks)


def first_fitting(model, batch: Batch, split: tuple, choices: Choices, budget: int) -> Parallel | None:
    """The cheapest ZeRO stage and recomputation setting `choices` allows with which `split` fits `budget`
    bytes (module docstring)."""
    tp, cp, pp, dp, _, schedule, v = split
    dims = ParallelDims(dp, pp, tp, cp, expert_ranks(model, dp))
    stages = (choices.zero,) if choices.zero else STAGES if dp > 1 else ("DDP",)
    for recompute in (choices.recompute,) if choices.recompute else SEARCHED:
        for zero in stages:
            strategy = choices.strategy(tp) | RECOMPUTE[recompute]
            parallel = Parallel(dims, zero, schedule=schedule, stages_per_rank=v, **strategy)
            try:
                check(model, batch, parallel, choices.precision)
            except ValueError:
                return None
            if likely_peak(model, batch, parallel, choices.precision) <= budget:
                return parallel
    return None


def price(
    model, batch: Batch, parallel: Parallel, precision: str, cluster: Cluster, assumptions: Assumptions
) -> Candidate:
    """One configuration's cost and predicted time, fitting or not (`--layout`); refused in one line if it
    cannot run (`distlab.cost.rules.check`)."""
    cost = step_cost(model, batch, parallel, precision, "cuda")
    return Candidate(cost, predict(cost, cluster, assumptions))


def least_memory(model, batch: Batch, gpus: int, cluster: Cluster, choices: Choices = Choices()) -> int | None:
    """The fewest bytes per GPU any split `choices` allows needs (ZeRO-3, full recomputation, the fewest bytes
    in flight, unless fixed otherwise): what "nothing fits" reports. None when no split can run at all."""
    best, precision = None, choices.precision
    for split in splits(model, batch, gpus, cluster.gpus_per_node, choices):
        tp, cp, pp, dp, m, schedule, v = split
        if v > 1:
            continue
        zero = choices.zero or ("ZeRO-3" if dp > 1 else "DDP")
        dims = ParallelDims(dp, pp, tp, cp, expert_ranks(model, dp))
        strategy = choices.strategy(tp) | RECOMPUTE[choices.recompute or "full"]
        parallel, batch = Parallel(dims, zero, schedule=schedule, **strategy), Batch(batch.global_batch, batch.seq, m)
        try:
            check(model, batch, parallel, precision)
        except ValueError:
            continue
        quick = likely_peak(model, batch, parallel, precision)
        if best is None or quick < best[0]:
            best = (quick, batch, parallel)
    if best is None:
        return None
    return step_cost(model, best[1], best[2], precision, "cuda").peak_held


def search(
    model: Transformer,
    batch: Batch,
    gpus: int,
    cluster: Cluster,
    choices: Choices = Choices(),
    assumptions: Assumptions | None = None,
    budget: int | None = None,
) -> list[Candidate]:
    """Every configuration `choices` allows that fits `budget` bytes a GPU (default: the device's memory less
    the default reserve), fastest first (ties: fewer pipeline, then tensor ranks)."""
    found, assumptions = [], assumptions or Assumptions()
    budget = budget if budget is not None else cluster.device.memory - int(DEFAULT_RESERVE_GIB * GIB)
    global_batch, seq = batch.global_batch, batch.seq
    for split in splits(model, batch, gpus, cluster.gpus_per_node, choices):
        batch = Batch(global_batch, seq, split[4])
        parallel = first_fitting(model, batch, split, choices, budget)
        if parallel is not None:
            cost = step_cost(model, batch, parallel, choices.precision, "cuda")
            if cost.peak_held <= budget:  # every rank, not only the first and the last
                found.append(Candidate(cost, predict(cost, cluster, assumptions)))
    return sorted(found, key=lambda c: (round(c.time.step, 9), c.parallel.pp, c.parallel.tp, c.parallel.label()))
