"""Tables and plots for benchmarks/contrastive_scaling.py: summary per method (largest N within the
memory cap, log-log exponents), the streamed step against its targets at the largest N (peak memory
<= 1/8 and loss-machinery time <= 1.2x of lesson 23's), a Markdown table and a PNG plot."""

from __future__ import annotations

import math
from pathlib import Path


def slope(points: list[tuple[int, float]]) -> float | None:
    """Log-log slope between the two largest N: 1 = linear, 2 = quadratic."""
    if len(points) < 2:
        return None
    (n0, v0), (n1, v1) = points[-2:]
    return math.log(v1 / v0) / math.log(n1 / n0)


def summarise(results: dict, cap: float) -> dict:
    summary = {}
    for part, per_method in results.items():
        for m, rows in per_method.items():
            done = [r for r in rows if "peak_bytes" in r and r["peak_bytes"] <= cap]
            summary.setdefault(part, {})[m] = {
                "largest_n_within_cap": max((r["n"] for r in done), default=None),
                "memory_slope": slope([(r["n"], r["peak_bytes"]) for r in done]),
                "time_slope": slope([(r["n"], r["time_s"]) for r in done]),
            }
    return summary


def targets(results: dict) -> dict:
    """At the largest N lesson 23 ran: the streamed step's peak memory <= 1/8 of lesson 23's and its
    loss-machinery time <= 1.2x."""
    loss = results["loss"]
    ran = [r["n"] for r in loss.get("12 local x global", []) if "peak_bytes" in r]
    if not ran:
        return {}
    n = max(ran)
    at = {m: next((r for r in rows if r["n"] == n and "peak_bytes" in r), None) for m, rows in loss.items()}
    out = {}
    for m in ("14 streamed, sharded", "14 streamed, replicated"):
        if at.get(m):
            mem_ratio = at[m]["peak_bytes"] / at["12 local x global"]["peak_bytes"]
            time_ratio = at[m]["time_s"] / at["12 local x global"]["time_s"]
            out[m] = {
                "n": n,
                "memory_vs_12": mem_ratio,
                "memory_target_met": mem_ratio <= 1 / 8,
                "time_vs_12": time_ratio,
                "time_target_met": time_ratio <= 1.2,
            }
    return out


def write_markdown(path: Path, meta: dict, results: dict, summary: dict, goals: dict) -> None:
    lines = [
        f"P = {meta['world']}, d = {meta['dim']}, {meta['dtype']}, B = {meta['micro']}, "
        f"T = {meta['chunk']}, tau = {meta['tau']}; device: {meta['device']}; cap {meta['cap_gib']} GiB per rank.",
        f"Command: `{meta['command']}`",
        "",
    ]
    for part, title in (
        ("loss", "Loss machinery (C x d embeddings in, dL/dZ_local out)"),
        ("step", "Whole training step (two-tower encoder 64 -> 256 -> d, SGD)"),
    ):
        if part not in results:
            continue
        methods = list(results[part])
        lines += [
            f"**{title}**: per-rank peak MiB / median seconds",
            "",
            "| N | " + " | ".join(methods) + " |",
            "|---:|" + "---:|" * len(methods),
        ]
        for i, n in enumerate(meta["sizes"]):
            cells = []
            for m in methods:
                r = results[part][m][i]
                cells.append(
                    f"{r['peak_bytes'] / 2**20:.1f} / {r['time_s']:.3f}"
                    if "peak_bytes" in r
                    else "over cap"
                    + (
                        f" (~{r['predicted_peak_bytes'] / 2**30:.2f} GiB predicted)"
                        if r.get("predicted_peak_bytes")
                        else ""
                    )
                )
            lines.append(f"| {n} | " + " | ".join(cells) + " |")
        lines.append(
            "| largest N within cap | "
            + " | ".join(str(summary[part][m]["largest_n_within_cap"]) for m in methods)
            + " |"
        )
        lines.append(
            "| memory exponent (last two N) | "
            + " | ".join(f"{s:.2f}" if (s := summary[part][m]["memory_slope"]) is not None else "-" for m in methods)
            + " |"
        )
        lines.append("")
    for m, g in goals.items():
        lines.append(
            f"- {m} at N = {g['n']}: peak memory {g['memory_vs_12']:.4f} x lesson 23's "
            f"(target <= 1/8: {'met' if g['memory_target_met'] else 'MISSED'}), loss-machinery time "
            f"{g['time_vs_12']:.2f} x (target <= 1.2: {'met' if g['time_target_met'] else 'MISSED'})"
        )
    path.write_text("\n".join(lines) + "\n")


def write_plot(path: Path, meta: dict, results: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = [p for p in ("loss", "step") if p in results]
    fig, axes = plt.subplots(len(parts), 2, figsize=(11, 4.2 * len(parts)), squeeze=False)
    for row, part in zip(axes, parts):
        for m, rows in results[part].items():
            done = [r for r in rows if "peak_bytes" in r]
            style = "-" if m.startswith("14") else "--"
            row[0].loglog([r["n"] for r in done], [r["peak_bytes"] / 2**20 for r in done], style, marker="o", label=m)
            row[1].loglog([r["n"] for r in done], [r["time_s"] for r in done], style, marker="o", label=m)
        row[0].axhline(meta["cap_gib"] * 1024, color="gray", lw=0.8, ls=":", label="cap")
        row[0].set(xlabel="global batch N", ylabel="peak MiB per rank", title=f"{part}: memory")
        row[1].set(xlabel="global batch N", ylabel="seconds (median)", title=f"{part}: time")
        for ax in row:
            ax.grid(True, which="both", alpha=0.3)
        row[0].legend(fontsize=8)
    fig.suptitle(f"Exact CLIP at P = {meta['world']}, d = {meta['dim']} ({meta['device']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
