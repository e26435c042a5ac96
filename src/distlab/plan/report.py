"""What the planner prints: the ranked configurations, the published runs beside their predictions, the
datasheet figures with their sources, and a picture (MFU against memory per GPU)."""

from __future__ import annotations

from rich.table import Table

from distlab.cost.hardware import DEVICES, GIB, LINKS, TERA, cluster
from distlab.cost.shapes import Parallel
from distlab.cost.step import step_cost
from distlab.cost.timing import Assumptions, predict
from distlab.plan.presets import MODELS, PUBLISHED
from distlab.plan.search import Candidate
from distlab.proof.console import compact_table

SCHEDULE_SHORT = {"1f1b": "1F1B", "interleaved-1f1b": "int", "gpipe": "GPipe"}


def _zero(p: Parallel) -> str:
    return "-" if p.dp == 1 else p.zero.removeprefix("ZeRO-") if p.zero != "DDP" else "DDP"


def _schedule(p: Parallel) -> str:
    if p.pp == 1:
        return "-"
    return SCHEDULE_SHORT.get(p.schedule, p.schedule) + (f" v{p.stages_per_rank}" if p.stages_per_rank > 1 else "")


def plan_table(found: list[Candidate], top: int, memory: int) -> Table:
    """The `top` fastest configurations that fit."""
    out = compact_table(
        f"The {min(top, len(found))} fastest of {len(found)} configurations that fit {memory / GIB:.0f} GiB",
        ("#", "dp", "tp", "pp", "cp", "ZeRO", "sched", "M", "rec", "GiB", "s", "MFU", "bubble"),
        caption="tp: with sequence parallelism (Megatron-LM's); ZeRO: the dp ranks' stage; sched: 1F1B, or int "
        "v2 (interleaved, 2 stages per rank); M: micro-batches per dp rank; rec: recomputation; GiB: the most "
        "any rank holds; s: predicted step time; bubble: the schedule's idle share",
    )
    for k, c in enumerate(found[:top], 1):
        p = c.parallel
        out.add_row(
            str(k),
            str(p.dp),
            str(p.tp),
            str(p.pp),
            str(p.cp),
            _zero(p),
            _schedule(p),
            str(c.cost.batch.micro_batches),
            "yes" if p.recompute else "no",
            f"{c.memory / GIB:.1f}",
            f"{c.time.step:.3g}",
            f"{c.time.mfu:.0%}",
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


def published_rows(assumptions: Assumptions) -> list[dict]:
    """Each published run's predicted memory and MFU beside what it reported."""
    rows = []
    for run in PUBLISHED:
        where = cluster(run.gpu)
        cost = step_cost(MODELS[run.model], run.batch, run.parallel, "bf16", "cuda")
        time = predict(cost, where, assumptions)
        rows.append(
            {
                "name": run.name,
                "split": run.parallel.label(),
                "memory_gib": cost.peak_held / GIB,
                "device_gib": where.device.memory / GIB,
                "fits": cost.peak_held <= where.device.memory,
                "predicted_mfu": time.mfu,
                "reported_mfu": run.reported_mfu,
                "ratio": time.mfu / run.reported_mfu,
                "source": run.source,
                "assumed": run.assumed,
            }
        )
    return rows


def published_table(rows: list[dict]) -> Table:
    out = compact_table(
        "Published runs: predicted memory must fit where they ran; MFU predicted beside MFU reported",
        ("run", "GiB", "of", "fits", "MFU", "reported", "ratio"),
        caption="GiB: the most any rank holds, predicted; of: the GPU's; ratio: predicted / reported MFU. Sources: "
        + "; ".join(sorted({r["source"] for r in rows})),
    )
    for r in rows:
        out.add_row(
            r["name"],
            f"{r['memory_gib']:.1f}",
            f"{r['device_gib']:.0f}",
            "yes" if r["fits"] else "NO",
            f"{r['predicted_mfu']:.0%}",
            f"{r['reported_mfu']:.0%}",
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
