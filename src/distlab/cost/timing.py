"""How long a step takes, predicted from its cost and a cluster; and MFU, computed the right way.

Per pipeline stage and micro-batch (a roofline, term by term):

    compute   = FLOPs (forward, backward, recomputation) / (dense peak of the precision x matmul efficiency)
    memory    = bytes the elementwise work moves / memory bandwidth: every activation kept is written in
                forward and read in backward, and so is its gradient (4 x the activations); the optimizer
                reads and writes the model states (2 x their bytes) once per step
    tp, cp    = for each collective: calls x ring steps x latency + bytes sent / (bandwidth x link efficiency)
                (a ring all-reduce takes 2 (P-1) steps, a gather or a scatter P-1, a ring message one)

Tensor parallelism's collectives sit between the products that need them: exposed. The ring of context
parallelism runs beside the attention it feeds: exposed only beyond the attention's compute. The pipeline's
sends are posted ahead (lesson 03) and the data-parallel reduction runs from hooks during backward (lesson
06), so both hide behind compute, except what is left when compute runs out: the last unit's reduction, or
ZeRO-3's first gather. On gloo here nothing overlaps (`Assumptions(overlap=())`): lesson 13 runs its
collectives between the computations.

A pipeline step is the schedule's grid (`distlab.pipeline.simulator.simulate`, lessons 02-05) at one tick per
stage forward of a micro-batch, a backward two ticks (three with recomputation); its idle cells are the
bubble. The step: that grid's length x the slowest stage's tick, plus the exposed data-parallel reduction,
plus the optimizer's memory traffic.

MFU = the model's FLOPs (forward + backward, no recomputation) / (step time x P x dense peak of the precision
the step computes in). Two mistakes give other numbers: counting recomputation as useful (that is HFU, which
flatters a step that recomputes), and dividing by the datasheet's headline figure, which is the 2:4-sparse
rate, twice the dense one (NVIDIA/Megatron-LM#1565: a 42% MFU read as 21%).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from distlab.cost.flops import attention_forward
from distlab.cost.hardware import Cluster, Link
from distlab.cost.memory import stage_activations
from distlab.cost.schedule import grid, stages
from distlab.cost.shapes import ORDER, PRECISIONS, Transformer, stage_layers
from distlab.cost.step import StepCost

RING_STEPS = {"all_reduce": lambda p: 2 * (p - 1), "all_gather": lambda p: p - 1, "reduce_scatter": lambda p: p - 1}


@dataclass(frozen=True)
class Assumptions:
    """What the prediction takes on faith, stated: the fraction of the dense peak large products reach,
    the fraction of a link's bandwidth a collective reaches (nccl-tests' bus bandwidth against the wire),
    and which dimensions' communication hides behind compute."""

    matmul_efficiency: float = 0.7
    link_efficiency: float = 0.8
    overlap: tuple[str, ...] = ("dp", "cp", "pp")

    def lines(self) -> list[str]:
        return [
            f"matrix products at {self.matmul_efficiency:.0%} of the dense peak",
            f"collectives at {self.link_efficiency:.0%} of a link's bandwidth",
            "overlapped with compute: " + (", ".join(self.overlap) or "nothing") + "; exposed: the rest",
        ]


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

    @property
    def busy(self) -> float:
        return self.compute + self.memory + sum(self.exposed.values())


def spans(cost: StepCost) -> dict[str, int]:
    """How many consecutive ranks each dimension's group spans, innermost first (tp, cp, pp, dp)."""
    sizes, stride, out = {"tp": cost.parallel.tp, "cp": cost.parallel.cp, "pp": cost.parallel.pp}, 1, {}
    sizes["dp"] = cost.parallel.dp
    for dim in ORDER:
        stride *= sizes[dim]
        out[dim] = stride
    return out


def collective_seconds(kind: str, nbytes: int, calls: int, group: int, link: Link, efficiency: float) -> float:
    """calls x ring steps x latency + bytes / usable bandwidth."""
    steps = RING_STEPS.get(kind, lambda p: 1)(group)
    return calls * steps * link.latency + nbytes / (link.bandwidth * efficiency)


def comm_seconds(cost: StepCost, pp_rank: int, links: dict, efficiency: float) -> dict[str, float]:
    """Seconds of each dimension's communication on one pipeline position's rank. `links`: a dimension's
    link, or a (dimension, collective)'s where one kind of collective runs at its own rate."""
    group = {"dp": cost.parallel.dp, "tp": cost.parallel.tp, "pp": cost.parallel.pp, "cp": cost.parallel.cp}
    out: dict[str, float] = {}
    rank = cost.ranks[pp_rank]
    for (dim, kind), nbytes in rank.traffic.sent.items():
        calls = rank.traffic.calls[dim, kind]
        link = links.get((dim, kind), links.get(dim))
        out[dim] = out.get(dim, 0.0) + collective_seconds(kind, nbytes, calls, group[dim], link, efficiency)
    return out


def predict(cost: StepCost, cluster: Cluster, assumptions: Assumptions = Assumptions(), links=None) -> StepTime:
    """The step time of `cost` on `cluster` (module docstring). `links`: each dimension's link (default: NVLink
    for a group that fits in a node, the network for one that does not)."""
    p, precision, device = cost.parallel, PRECISIONS[cost.precision], cluster.device
    links = links or {dim: cluster.link(span) for dim, span in spans(cost).items()}
    rate = device.peak[precision.name] * assumptions.matmul_efficiency
    ticks_per_mb = 4 if p.recompute else 3
    worst = None
    for rank in cost.ranks:
        m = cost.batch.micro_batches
        acts = sum(
            stage_activations(cost.model, cost.batch, p, s, precision, precision.e)
            for s in stages(p, cost.batch, rank.pp_rank)
        )
        compute, memory = rank.flops.hardware / rate, 4 * m * acts / device.bandwidth
        comm = comm_seconds(cost, rank.pp_rank, links, assumptions.link_efficiency)
        exposed = {dim: t for dim, t in comm.items() if dim not in assumptions.overlap}
        if "cp" in comm and "cp" in assumptions.overlap and isinstance(cost.model, Transformer):
            layers = sum(len(stage_layers(cost.model, p)[s]) for s in stages(p, cost.batch, rank.pp_rank))
            rows = cost.batch.global_batch // (p.dp * m)
            attention = 3 * m * layers * attention_forward(cost.model, rows, cost.batch.seq, p.tp, p.cp) / rate
            exposed["cp"] = max(0.0, comm["cp"] - attention)
        ticks = m * p.stages_per_rank * ticks_per_mb  # the rank's own: every stage it holds, every micro-batch
        per_tick = (compute + memory + exposed.get("tp", 0.0) + exposed.get("cp", 0.0)) / ticks
        if worst is None or per_tick > worst[0]:
            worst = (per_tick, compute, memory, comm, exposed, rank)
    per_tick, compute, memory, comm, exposed, rank = worst
    ticks, bubble = grid(p, cost.batch)
    states = sum(v for k, v in rank.memory.items() if k not in ("activations", "buffers"))
    optimizer = 2 * states / device.bandwidth
    if "dp" in comm and "dp" in assumptions.overlap:  # hidden behind backward, but the last unit's share
        units = max(
            1, rank.traffic.calls.get(("dp", "all_reduce"), 0) + rank.traffic.calls.get(("dp", "reduce_scatter"), 0)
        )
        exposed["dp"] = max(comm["dp"] / units, comm["dp"] - compute * 2 / 3)
    step = ticks * per_tick + exposed.get("dp", 0.0) + exposed.get("pp", 0.0) + optimizer
    world = p.world
    dense, sparse = device.peak[precision.name], device.sparse.get(precision.name, device.peak[precision.name])
    return StepTime(
        compute,
        memory + optimizer,
        comm,
        exposed,
        bubble,
        step,
        cost.model_flops / (step * world * dense),
        cost.hardware_flops / (step * world * dense),
        cost.model_flops / (step * world * sparse),
    )


def mfu(model_flops: int, seconds: float, ranks: int, dense_peak: float) -> float:
    """The right way: the model's FLOPs (no recomputation) over the dense peak of the precision used."""
    return model_flops / (seconds * ranks * dense_peak)
