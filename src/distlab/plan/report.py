"""What the planner prints: the ranked configurations, the published runs beside their predictions, the
datasheet figures with their sources, and a picture (MFU against memory per GPU)."""

from __future__ import annotations

from dataclasses import replace

from rich.table import Table

from distlab.cost import memory
from distlab.cost.inputs import PRECISIONS, Parallel
from distlab.cost.stacks import STACKS
from distlab.cost.step import step_cost
from distlab.cost.timing import Assumptions, needed_flops, predict
from distlab.data_split.sharding.accounting import layer_norm_stat_bytes
from distlab.layer_split.tensor_parallel.cost import sdpa_math_path
from distlab.plan.presets import MODELS, PUBLISHED
from distlab.plan.search import Candidate
from distlab.processes.console import compact_table, console
from distlab.proof.hardware import DEFAULT_RESERVE_GIB, DEVICES, GIB, LINKS, TERA, Cluster, Device, cluster

SCHEDULE_SHORT = {
    "1f1b": "1F1B",
    "interleaved-1f1b": "int",
    "gpipe": "GPipe",
    "zb-h1": "ZB",
    "interleaved-zb": "iZB",
    "dualpipev": "DPV",
    "dualpipe": "DP",
}
ITEMS = (  # what a rank holds, item by item, as the other calculators break it down
    "weights",
    "gradients",
    "optimizer states",
    "master weights",
    "activations",
    "pipeline in-flight",
    "communication buffers",
    "reserve",
)


def _count(n: float) -> str:
    return f"{n / 1e9:,.1f} B" if n >= 1e9 else f"{n / 1e6:,.0f} M"


def header(name: str, model, tokens: int, gpus: int, where: Cluster, precision: str) -> str:
    """What is planned: the model, its parameters (active ones for a mixture), the tokens and the cluster."""
    active = f" ({_count(model.active_parameters)} active)" if getattr(model, "experts", 0) else ""
    nodes = gpus // where.gpus_per_node  # the cluster's nodes are full (`cli.check_cluster`)
    return (
        f"{name}: {_count(model.parameters)} parameters{active}; {tokens:,} tokens per step on {gpus} x "
        f"{where.device.name} ({nodes} node{'s' * (nodes > 1)}), {precision}"
    )


def memory_items(candidate: Candidate, reserve: int) -> dict[str, int]:
    """Bytes the fullest rank holds, by `ITEMS` (the cost model's items, named as practitioners name them:
    optimizer states = AdamW's moments and step counts; pipeline in-flight = the micro-batches beyond one
    that the schedule keeps at once), and the reserve."""
    cost = candidate.cost
    rank = max(cost.ranks, key=lambda r: r.held)
    held, precision = rank.memory, PRECISIONS[cost.precision]
    stat_bytes = layer_norm_stat_bytes(precision.e, "cuda")
    math = sdpa_math_path("cuda", memory.DTYPE_OF[precision.e])
    parts = memory.activation_parts(cost.model, cost.batch, cost.parallel, precision, rank.pp_rank, stat_bytes, math)
    return {
        "weights": held.get("weights", 0),
        "gradients": held.get("gradients", 0),
        "optimizer states": held.get("moments", 0) + held.get("step counts", 0),
        "master weights": held.get("master copy", 0) + held.get("shard copy", 0),
        "activations": parts["activations"],
        "pipeline in-flight": parts["pipeline in-flight"],
        "communication buffers": held.get("buffers", 0),
        "reserve": reserve,
    }


def candidate_json(candidate: Candidate, reserve: int, device: Device) -> dict:
    """One configuration as --json writes it: step_s, mfu, hfu, memory_gib (every item, the reserve too),
    memory (GiB by item), whether it fits the device."""
    items = memory_items(candidate, reserve)
    total = sum(items.values())
    return {
        "layout": candidate.parallel.label(),
        "dims": {d: getattr(candidate.parallel, d) for d in ("dp", "pp", "tp", "cp", "ep")},
        "micro_batches": candidate.cost.batch.micro_batches,
        "step_s": candidate.time.step,
        "mfu": candidate.time.mfu,
        "tflops_per_gpu": candidate.time.tflops,
        "hfu": candidate.time.hfu,
        "bubble": candidate.time.bubble,
        "memory_gib": total / GIB,
        "memory": {k: v / GIB for k, v in items.items()},
        "device_gib": device.memory / GIB,
        "fits": total <= device.memory,
        "exposed_s": dict(candidate.time.exposed),
        "time_s": dict(candidate.time.items),
    }


def layout_line(candidate: Candidate, result: dict) -> str:
    """One layout's time and utilisation, one line."""
    return (
        f"{candidate.parallel.label()}, M = {candidate.cost.batch.micro_batches} micro-batches: "
        f"{result['step_s']:.3g} s a step, MFU {result['mfu']:.1%} ({result['tflops_per_gpu']:.0f} TFLOP/s a GPU), "
        f"HFU {result['hfu']:.1%}, "
        f"bubble {result['bubble']:.0%}"
    )


def layout_table(candidate: Candidate, result: dict, device: Device) -> Table:
    """One layout's memory item by item, on its fullest rank."""
    verdict = "fits" if result["fits"] else f"does NOT fit, {result['memory_gib'] - device.memory / GIB:.1f} GiB over"
    out = compact_table(
        "Memory of the fullest rank",
        ("item", "GiB"),
        caption=f"{result['memory_gib']:.2f} of the {device.name}'s {device.memory / GIB:.2f} GiB: {verdict}",
    )
    for item, value in result["memory"].items():
        out.add_row(item, f"{value:.2f}")
    out.add_row("total", f"{result['memory_gib']:.2f}")
    return out


def time_table(candidate: Candidate) -> Table:
    """Where one layout's step goes, item by item, on its slowest pipeline position (they add up to the step)."""
    step = candidate.time.step
    out = compact_table("Where the step goes", ("item", "s", "share"), caption=f"{step:.3g} s a step in all")
    for item, seconds in candidate.time.items.items():
        out.add_row(item, f"{seconds:.3g}", f"{seconds / step:.0%}")
    return out


def nothing_fits(least: int | None, reserve: int, device: Device) -> str:
    """The refusal with its margin: what the most frugal split needs, and how much more than the device holds."""
    if least is None:
        return "nothing fits: no split of these sizes can run (the sizes divide no layout of these GPUs)"
    need = least + reserve
    return (
        f"nothing fits: the best layout needs {need / GIB:.1f} GiB per GPU ({reserve / GIB:.1f} of it the reserve), "
        f"{(need - device.memory) / GIB:.1f} GiB more than the {device.name} holds ({device.memory / GIB:.2f} GiB)"
    )


def print_assumptions(assumptions: Assumptions, where: Cluster, reserve: int) -> None:
    lines = assumptions.lines() + [
        f"a reserve of {reserve / GIB:.1f} GiB per GPU for the CUDA context, NCCL's buffers and fragmentation "
        f"(--reserve-gib; default {DEFAULT_RESERVE_GIB})",
        f"{where.device.name}: {where.device.memory / GIB:.2f} GiB as the driver reports it; {where.device.source}",
        f"links: {where.intra.name} inside a node of {where.gpus_per_node}, {where.inter.name} across nodes",
    ]
    for line in lines:
        console.print("  " + line, highlight=False)


def _zero(p: Parallel) -> str:
    return "-" if p.dp == 1 else p.zero.removeprefix("ZeRO-") if p.zero != "DDP" else "DDP"


def _schedule(p: Parallel) -> str:
    if p.pp == 1:
        return "-"
    return SCHEDULE_SHORT.get(p.schedule, p.schedule) + (f" v{p.stages_per_rank}" if p.stages_per_rank > 1 else "")


def plan_table(found: list[Candidate], top: int, budget: int) -> Table:
    """The `top` fastest configurations that fit `budget` bytes (the device's memory less the reserve)."""
    out = compact_table(
        f"The {min(top, len(found))} fastest of {len(found)} configurations that fit {budget / GIB:.1f} GiB",
        ("#", "dp", "tp", "pp", "cp", "ep", "ZeRO", "sched", "M", "rec", "GiB", "s", "MFU", "TF/GPU", "bubble"),
        caption="tp: with sequence parallelism (Megatron-LM's) unless --sp off; ZeRO: the dp ranks' stage; sched: "
        "1F1B, or int v2 (interleaved, 2 stages per rank); M: micro-batches per dp rank; rec: recomputation (sel: "
        "Megatron's selective, act: the MLP's activation function); GiB: the most any rank holds, the reserve "
        "apart; s: predicted step time; TF/GPU: the model's TFLOP/s a GPU; bubble: the schedule's idle share",
    )
    for k, c in enumerate(found[:top], 1):
        p = c.parallel
        out.add_row(
            str(k),
            str(p.dp),
            str(p.tp),
            str(p.pp),
            str(p.cp),
            str(p.ep),
            _zero(p),
            _schedule(p),
            str(c.cost.batch.micro_batches),
            "yes" if p.recompute else "sel" if p.selective else "act" if p.act_fn else "no",
            f"{c.memory / GIB:.1f}",
            f"{c.time.step:.3g}",
            f"{c.time.mfu:.0%}",
            f"{c.time.tflops:.0f}",
            f"{c.time.bubble:.0%}",
        )
    return out


def devices_table() -> Table:
    """The datasheet figures the planner uses, each with its source."""
    out = compact_table(
        "Datasheet figures per GPU (dense: without 2:4 sparsity; sparse figures are twice these)",
        ("GPU", "bf16 TF", "fp16 TF", "fp8 TF", "GiB", "HBM TB/s", "node GB/s", "net GB/s"),
        caption="TF: dense TFLOP/s; node: NVLink 4 (H100, H200), 3 (A100), 5 (B200), xGMI (MI300X), per direction; "
        "net: one NIC per GPU. Sources: " + "; ".join(d.source for d in DEVICES.values()),
    )
    for key, d in DEVICES.items():
        intra, inter = LINKS[key]
        out.add_row(
            d.name,
            f"{d.peak['bf16'] / TERA:,.0f}",
            f"{d.peak['fp16'] / TERA:,.0f}",
            f"{d.peak['fp8'] / TERA:,.0f}" if "fp8" in d.peak else "-",
            f"{d.memory / GIB:.0f}",
            f"{d.bandwidth / TERA:.2f}",
            f"{intra.bandwidth / 1e9:.0f}",
            f"{inter.bandwidth / 1e9:.0f}",
        )
    return out


def _measures(run, cost, time, assumptions: Assumptions) -> tuple[str, str, float]:
    """(predicted, published, predicted / published throughput) in the report's own measure: MFU, seconds a
    step, or hardware TFLOP/s a GPU as Megatron-LM counts them (recomputation and the whole square in)."""
    if run.reported_step_s:
        return f"{time.step:.1f} s", f"{run.reported_step_s:.1f} s", run.reported_step_s / time.step
    if run.reported_tflops:
        tflops = cost.hardware_flops / (time.step * cost.parallel.world) / 1e12
        return f"{tflops:.0f} TF", f"{run.reported_tflops:.0f} TF", tflops / run.reported_tflops
    needed, _ = needed_flops(cost, assumptions)
    mfu = time.mfu * (cost.model_flops / needed if run.full_square else 1)  # the report's numerator
    return f"{mfu:.0%}", f"{run.reported_mfu:.0%}", mfu / run.reported_mfu


def published_rows(overrides: dict | None = None) -> list[dict]:
    """Each published run's predicted memory and throughput beside what it reported, priced with its stack's
    profile (`distlab.cost.stacks`; `overrides`: assumptions replaced for every run, the flags' or a test's)."""
    rows = []
    for run in PUBLISHED:
        where = cluster(run.gpu, 8, run.inter_node_gbps)
        assumptions = replace(STACKS[run.stack].assumptions, **(overrides or {}))
        cost = step_cost(MODELS[run.model], run.batch, run.parallel, "bf16", "cuda")
        time = predict(cost, where, assumptions)
        predicted, reported, ratio = _measures(run, cost, time, assumptions)
        rows.append(
            {
                "name": run.name,
                "split": run.parallel.label(),
                "stack": run.stack,
                "fitted": run.fitted,
                "memory_gib": cost.peak_held / GIB,
                "device_gib": where.device.memory / GIB,
                "fits": cost.peak_held <= where.device.memory,
                "headroom_gib": (where.device.memory - cost.peak_held) / GIB - DEFAULT_RESERVE_GIB,
                "predicted": predicted,
                "reported": reported,
                "ratio": ratio,
                "source": run.source,
                "assumed": run.assumed,
            }
        )
    return rows


def published_table(rows: list[dict]) -> Table:
    out = compact_table(
        "Published runs: predicted memory must fit where they ran; throughput predicted beside reported",
        ("run", "set", "GiB", "of", "fits", "left", "predicted", "reported", "ratio"),
        caption="set: fit (its stack's profile was fitted on it) or held out; GiB: the most any rank holds, "
        "predicted; of: the GPU's; left: what remains after the default "
        f"reserve of {DEFAULT_RESERVE_GIB} GiB; predicted, reported: in the report's own measure (MFU, counted as "
        "it counts it; seconds a step; TF: hardware TFLOP/s a GPU, Megatron-LM's count); ratio: predicted / "
        "reported throughput. Sources: " + "; ".join(sorted({r["source"] for r in rows})),
    )
    for r in rows:
        out.add_row(
            r["name"],
            "fit" if r["fitted"] else "held out",
            f"{r['memory_gib']:.1f}",
            f"{r['device_gib']:.0f}",
            "yes" if r["fits"] else "NO",
            f"{r['headroom_gib']:.1f}",
            r["predicted"],
            r["reported"],
            f"{r['ratio']:.2f}",
        )
    return out


def plot(found: list[Candidate], path: str, title: str) -> None:
    """MFU against the memory a configuration needs per GPU, every one that fits; the best one marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for pp in sorted({c.parallel.pp for c in found}):
        mine = [c for c in found if c.parallel.pp == pp]
        ax.scatter([c.memory / GIB for c in mine], [100 * c.time.mfu for c in mine], s=14, label=f"pp = {pp}")
    best = found[0]
    ax.scatter(
        [best.memory / GIB], [100 * best.time.mfu], s=160, marker="*", color="black", label=best.parallel.label()
    )
    ax.set_xlabel("memory per GPU, GiB (the most any rank holds)")
    ax.set_ylabel("predicted MFU, %")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
