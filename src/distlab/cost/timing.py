"""How long a step takes, predicted from its cost and a cluster; and MFU, computed the right way.

Per pipeline stage and micro-batch (a roofline, term by term):

    compute   = each matrix product's FLOPs / (dense peak of the precision x its shape's efficiency: the
                large-product efficiency less tile and wave quantisation on the device's SMs), and attention's
                seq^2 products at the share a causal kernel computes, at the attention kernel's efficiency
    memory    = bytes the elementwise work moves / memory bandwidth: every activation kept is written in
                forward and read in backward, and so is its gradient (4 x the activations); the optimizer
                reads and writes the model states (2 x their bytes) once per step
    tp, cp    = for each collective: calls x ring steps x latency + bytes sent / (bandwidth x link efficiency)
                (a ring all-reduce takes 2 (P-1) steps, a gather or a scatter P-1, a ring message one)

Tensor parallelism's collectives sit between the products that need them: exposed. The ring of context
parallelism runs beside the attention it feeds: exposed only beyond the attention's compute; expert
parallelism's all-to-all hides behind the other micro-batch's compute (DualPipe's overlap), at most half of
it. The pipeline's
sends are posted ahead (lesson 03) and the data-parallel reduction runs from hooks during backward (lesson
06), so both hide behind compute, except what is left when compute runs out: the last unit's reduction, or
ZeRO-3's first gather. On gloo here nothing overlaps (`Assumptions(overlap=())`): lesson 13 runs its
collectives between the computations.

The pipeline's sends hide behind compute but for each message's latency, which the stage waiting on it pays
(exposed: the rank's sends x the link's latency). A pipeline step is the schedule's grid
(`distlab.model_split.simulator.simulate`, lessons 02-05) at one tick per stage forward of a micro-batch, a
backward two ticks (three with recomputation); its idle cells are the bubble. The step: that grid's length x
the slowest stage's tick, plus the exposed data-parallel reduction and pipeline latency, plus the optimizer's
memory traffic. `StepTime.items` is that sum item by item (matrix products, attention, elementwise and norms,
each dimension's exposed communication, the pipeline bubble, the optimizer step), as the planner prints it.

MFU = the model's FLOPs (forward + backward, no recomputation, causal attention's masked half not counted:
`needed_flops`) / (step time x P x dense peak of the precision the step computes in; bf16's for fp8). Two
mistakes give other numbers: counting recomputation as useful (that is HFU, which flatters a step that
recomputes), and dividing by the datasheet's headline figure, which is the 2:4-sparse
rate, twice the dense one (NVIDIA/Megatron-LM#1565: a 42% MFU read as 21%).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from distlab.cost.flops import attention_forward
from distlab.cost.inputs import PRECISIONS, lasts, stage_layers
from distlab.cost.memory import stage_activations
from distlab.cost.schedule import grid, passes, stages
from distlab.cost.step import StepCost
from distlab.proof.hardware import Cluster, Link
from distlab.proof.sizes import Transformer

RING_STEPS = {"all_reduce": lambda p: 2 * (p - 1), "all_gather": lambda p: p - 1, "reduce_scatter": lambda p: p - 1}


@dataclass(frozen=True)
class Assumptions:
    """What the prediction takes on faith, stated and overridable (the planner's flags of the same names):

    matmul_efficiency     the share of the dense peak a large, well-shaped matrix product reaches (cuBLAS on
                          an H100 reaches about 75-80% in bf16); smaller or ragged products reach less, by
                          tile and wave quantisation on the device's SMs (`gemm_efficiency`)
    attention_efficiency  the share of the dense peak the fused attention kernel reaches (FlashAttention-2/3
                          forward and backward together, about half)
    attention_share       the share of the seq^2 products a causal kernel computes (it skips the masked
                          tiles: about half; 1 for a kernel that computes the whole square)
    link_efficiency       the share of a link's bandwidth a collective reaches (nccl-tests' bus bandwidth)
    overlap               the dimensions whose communication hides behind compute"""

    matmul_efficiency: float = 0.8
    link_efficiency: float = 0.8
    overlap: tuple[str, ...] = ("dp", "cp", "pp", "ep")
    attention_efficiency: float = 0.5
    attention_share: float = 0.5
    tile: tuple[int, int] = (128, 256)  # the output tile one SM computes (CUTLASS/cuBLAS on Hopper)

    def lines(self) -> list[str]:
        return [
            f"matrix products at {self.matmul_efficiency:.0%} of the dense peak when large, less by tile "
            f"({self.tile[0]} x {self.tile[1]}) and wave quantisation on the SMs (--matmul-efficiency)",
            f"attention at {self.attention_efficiency:.0%} of the dense peak, {self.attention_share:.0%} of its "
            "seq^2 products computed (causal) (--attention-efficiency, --attention-share)",
            f"collectives at {self.link_efficiency:.0%} of a link's bandwidth: NVLink inside a node, the network "
            "across nodes (--link-efficiency)",
            "overlapped with compute: " + (", ".join(self.overlap) or "nothing") + "; exposed: the rest (--overlap)",
        ]


def gemm_efficiency(m: int, n: int, k: int, sms: int, assumptions: Assumptions) -> float:
    """The share of the dense peak an (m x k) @ (k x n) product reaches: the large-product efficiency times
    the tile quantisation (the output is computed in whole tiles: m n / (tiles x tile area) of the work is
    useful) times the wave quantisation (the tiles run in waves of one per SM: a last wave half full idles
    half the SMs). `sms` 0: a device without SMs (a CPU, measured): no quantisation."""
    if not sms or not m or not n:
        return assumptions.matmul_efficiency
    tm, tn = assumptions.tile
    tiles = math.ceil(m / tm) * math.ceil(n / tn)
    useful = m * n / (tiles * tm * tn)
    waves = tiles / (math.ceil(tiles / sms) * sms)
    short_k = min(1.0, k / 512)  # a product too thin to fill the pipeline of its loads: the planner's guess
    return assumptions.matmul_efficiency * useful * waves * (0.5 + 0.5 * short_k)


def products_seconds(cost: StepCost, pp_rank: int, rate: float, sms: int, assumptions: Assumptions) -> float:
    """Seconds of the rank's matrix products, each at its shape's efficiency (forward's shapes, for
    backward and recomputation too): one micro-batch's T = rows x seq / cp tokens through every weight."""
    model, p, batch = cost.model, cost.parallel, cost.batch
    rank = cost.ranks[pp_rank]
    if not isinstance(model, Transformer):
        return rank.flops.hardware / (rate * assumptions.matmul_efficiency)
    tokens = batch.global_batch // (p.dp * batch.micro_batches) * (batch.seq // p.cp)
    useful = weighted = 0.0
    layers = [i for s in stages(p, batch, pp_rank) for i in stage_layers(model, p)[s]]
    weights = [w for i in layers for w in model.layer_weights(i)]
    if model.vocab and any(s in lasts(p) for s in stages(p, batch, pp_rank)):
        weights.append(model.head_matrix())
    for w in weights:
        if w.cols == 1 or w.name == "embed.weight":
            continue
        rows, cols = (
            (w.rows // p.tp, w.cols) if w.split == "column" else (w.rows, w.cols // (p.tp if w.split == "row" else 1))
        )
        m = tokens * model.top_k * p.ep // w.experts if w.experts else tokens
        f = 2 * tokens * w.per_token(p.tp, model.top_k)
        useful += f
        weighted += f / gemm_efficiency(m, rows, cols, sms, assumptions)
    attention = attention_flops(cost, pp_rank)
    products = rank.flops.hardware - attention
    return products * (weighted / useful if useful else 1 / assumptions.matmul_efficiency) / rate


def attention_flops(cost: StepCost, pp_rank: int) -> int:
    """The seq^2 products of the rank's step, counted whole (forward, backward twice, recomputation)."""
    model, p, batch = cost.model, cost.parallel, cost.batch
    if not isinstance(model, Transformer):
        return 0
    layers = sum(len(stage_layers(model, p)[s]) for s in stages(p, batch, pp_rank))
    rows = batch.global_batch // (p.dp * batch.micro_batches)
    runs = 4 if p.recompute or p.selective else 3  # full, or Megatron's selective: attention's forward again
    return runs * passes(p, batch) * layers * attention_forward(model, rows, batch.seq, p.tp, p.cp)


@dataclass
class StepTime:
    """Seconds per step, the slowest pipeline position's terms, and the utilisations."""

    compute: float
    memory: float
    comm: dict[str, float] = field(default_factory=dict)  # per dimension, all of it
    exposed: dict[str, float] = field(default_factory=dict)  # per dimension, what compute does not hide
    bubble: float = 0.0  # the schedule's idle fraction
    step: float = 0.0
    mfu: float = 0.0
    hfu: float = 0.0
    mfu_sparse_peak: float = 0.0  # the mistake: the 2:4-sparse figure as the denominator
    tflops: float = 0.0  # the model's FLOP/s a GPU, in 10^12 (MFU x the dense peak): what papers report
    items: dict[str, float] = field(default_factory=dict)  # the step, item by item (`predict`)

    @property
    def busy(self) -> float:
        return self.compute + self.memory + sum(self.exposed.values())


def collective_seconds(kind: str, nbytes: int, calls: int, group: int, link: Link, efficiency: float) -> float:
    """calls x ring steps x latency + bytes / usable bandwidth."""
    steps = RING_STEPS.get(kind, lambda p: 1)(group)
    return calls * steps * link.latency + nbytes / (link.bandwidth * efficiency)


def comm_seconds(cost: StepCost, pp_rank: int, links: dict, efficiency: float) -> dict[str, float]:
    """Seconds of each dimension's communication on one pipeline position's rank. `links`: a dimension's
    link, or a (dimension, collective)'s where one kind of collective runs at its own rate."""
    p = cost.parallel
    group = {"dp": p.dp, "tp": p.tp, "pp": p.pp, "cp": p.cp, "ep": p.ep}
    out: dict[str, float] = {}
    rank = cost.ranks[pp_rank]
    for (dim, kind), nbytes in rank.traffic.sent.items():
        calls = rank.traffic.calls[dim, kind]
        link = links.get((dim, kind), links.get(dim))
        out[dim] = out.get(dim, 0.0) + collective_seconds(kind, nbytes, calls, group[dim], link, efficiency)
    return out


def predict(cost: StepCost, cluster: Cluster, assumptions: Assumptions = Assumptions(), links=None) -> StepTime:
    """The step time of `cost` on `cluster` (module docstring). `links`: each dimension's link (default: NVLink
    for a group that fits in a node, the network for one that does not, by the one rank order `dims.LAYOUT`)."""
    p, precision, device = cost.parallel, PRECISIONS[cost.precision], cluster.device
    links = links or {dim: cluster.link(span) for dim, span in p.dims.spans().items()}
    rate = device.peak[precision.rate]
    ticks_per_mb = 4 if p.recompute else 3
    worst = None
    for rank in cost.ranks:
        m = passes(p, cost.batch)  # micro-batches through each stage the rank holds
        acts = sum(
            stage_activations(cost.model, cost.batch, p, s, precision, precision.e)
            for s in stages(p, cost.batch, rank.pp_rank)
        )
        attention = attention_flops(cost, rank.pp_rank)
        attention_s = assumptions.attention_share * attention / (rate * assumptions.attention_efficiency)
        if not device.sms:  # a measured device: its products' rate was measured whole, attention included
            attention_s = attention / (rate * assumptions.matmul_efficiency)
        compute = products_seconds(cost, rank.pp_rank, rate, device.sms, assumptions) + attention_s
        memory = 4 * m * acts / device.bandwidth
        comm = comm_seconds(cost, rank.pp_rank, links, assumptions.link_efficiency)
        exposed = {dim: t for dim, t in comm.items() if dim not in assumptions.overlap}
        if "cp" in comm and "cp" in assumptions.overlap and isinstance(cost.model, Transformer):
            exposed["cp"] = max(0.0, comm["cp"] - attention_s)
        if "ep" in comm and "ep" in assumptions.overlap:  # DualPipe-style: hidden behind the other micro-batch's
            exposed["ep"] = max(0.0, comm["ep"] - compute / 2)  # compute, at most half of it
        own = cost.batch.micro_batches * p.stages_per_rank * ticks_per_mb  # the rank's own ticks: every stage it
        # holds, every micro-batch (DualPipe: M / 2 through each of its two whole chunks, as many ticks as the V's)
        per_tick = (compute + memory + exposed.get("tp", 0.0) + exposed.get("cp", 0.0) + exposed.get("ep", 0.0)) / own
        if worst is None or per_tick > worst[0]:
            worst = (per_tick, compute, memory, comm, exposed, rank, attention_s, own)
    per_tick, compute, memory, comm, exposed, rank, attention_s, own = worst
    ticks, bubble = grid(p, cost.batch)
    if "pp" in comm and "pp" in assumptions.overlap:  # the bytes hide behind compute, not each message's latency:
        sends = sum(n for (dim, _), n in rank.traffic.calls.items() if dim == "pp")  # a stage waits for it
        exposed["pp"] = sends * links["pp"].latency
    states = sum(v for k, v in rank.memory.items() if k not in ("activations", "buffers"))
    optimizer = 2 * states / device.bandwidth
    if "dp" in comm and "dp" in assumptions.overlap:  # hidden behind backward, but the last unit's share
        units = max(
            1, rank.traffic.calls.get(("dp", "all_reduce"), 0) + rank.traffic.calls.get(("dp", "reduce_scatter"), 0)
        )
        exposed["dp"] = max(comm["dp"] / units, comm["dp"] - compute * 2 / 3)
    step = ticks * per_tick + exposed.get("dp", 0.0) + exposed.get("pp", 0.0) + optimizer
    items = {  # where the slowest position's step goes; they add up to `step`
        "matrix products": compute - attention_s,
        "attention": attention_s,
        "elementwise and norms": memory,
        **{f"{dim} exposed": exposed[dim] for dim in ("tp", "cp", "ep", "dp", "pp") if exposed.get(dim)},
        "pipeline bubble": per_tick * (ticks - own),
        "optimizer step": optimizer,
    }
    world = p.world
    dense = device.peak[precision.mfu_peak]
    sparse = device.sparse.get(precision.mfu_peak, dense)
    needed, done = needed_flops(cost, assumptions)
    return StepTime(
        compute,
        memory + optimizer,
        comm,
        exposed,
        bubble,
        step,
        needed / (step * world * dense),
        done / (step * world * dense),
        needed / (step * world * sparse),
        needed / (step * world) / 1e12,
        items,
    )


def needed_flops(cost: StepCost, assumptions: Assumptions) -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs) of the step, with causal attention's seq^2 products at the share a
    causal kernel computes (`attention_share`): the masked half is work the model does not need, so MFU does
    not count it (at 128K tokens it is most of a Llama's FLOPs). With share 1, FlopCounterMode's count."""
    model, batch = cost.model, cost.batch
    if not isinstance(model, Transformer) or assumptions.attention_share == 1:
        return cost.model_flops, cost.hardware_flops
    forward = model.layers * attention_forward(model, batch.global_batch, batch.seq)  # the whole square, once
    runs = 3 + (1 if cost.parallel.recompute or cost.parallel.selective else 0)  # forward, backward, recomputed
    masked = 1 - assumptions.attention_share
    return cost.model_flops - masked * 3 * forward, cost.hardware_flops - masked * runs * forward


def mfu(model_flops: int, seconds: float, ranks: int, dense_peak: float) -> float:
    """The right way: the model's FLOPs (no recomputation) over the dense peak of the precision used."""
    return model_flops / (seconds * ranks * dense_peak)
