"""Tables and plots for benchmarks/clip_step.py: every time with its ratio to the 6 C N d floor and to
the part's baseline (open_clip's recipe), memory against P at a fixed C, and the targets, met or not."""

from __future__ import annotations

import json
from pathlib import Path

from clip_step_launches import launch_markdown
from clip_step_losses import (
    B_C8,
    B_EQ_C,
    BASE,
    BIDIR,
    FLOOR,
    FLOOR_4,
    FLOORS,
    OPEN_CLIP,
    RING,
    SIG_GATHER,
    SIGMOID,
    SIGMOID_RING,
    SIGMOIDS,
)

from distlab.proof.memory import MIB

TITLES = {
    "step": "Whole training step, InfoNCE (two-tower encoder 64 -> 256 -> d, AdamW)",
    "loss": "InfoNCE loss machinery (C x d embeddings in, dL/dZ out)",
    "sigmoid": "Sigmoid loss machinery (s = 10, beta = -10; C x d embeddings in, dL/dZ out)",
}
COLOURS = {
    OPEN_CLIP: "tab:red",
    B_EQ_C: "tab:blue",
    B_C8: "tab:green",
    RING: "tab:purple",
    FLOOR: "black",
    FLOOR_4: "grey",
    BIDIR: "tab:red",
    SIG_GATHER: "tab:orange",
    SIGMOID: "tab:blue",
    SIGMOID_RING: "tab:purple",
}


def _at(rows: list[dict], n: int) -> dict:
    return next(r for r in rows if r["n"] == n)


def _ratios(part: dict, method: str, base: str, sizes: list[int]) -> dict:
    """N -> {time, memory}: the method's over the base's at each N."""
    return {
        n: {
            "time": _at(part[method], n)["time_s"] / _at(part[base], n)["time_s"],
            "memory": _at(part[method], n)["peak_bytes"] / _at(part[base], n)["peak_bytes"],
        }
        for n in sizes
    }


def targets(results: dict, sizes: list[int]) -> list[dict]:
    """The targets of the P = 2 run, each with the measured ratios and whether it holds."""
    step, loss, sigmoid = (results.get(part, {}) for part in ("step", "loss", "sigmoid"))
    big, out = [n for n in sizes if n >= 8192], []
    if OPEN_CLIP in step and B_EQ_C in step:
        got = _ratios(step, B_EQ_C, OPEN_CLIP, sizes)
        out.append(
            {
                "target": "B = C step: time <= 1.0x open_clip's and less peak memory, every N",
                "measured": got,
                "met": all(r["time"] <= 1.0 and r["memory"] < 1.0 for r in got.values()),
            }
        )
    if OPEN_CLIP in step and B_C8 in step and big:
        got = _ratios(step, B_C8, OPEN_CLIP, big)
        out.append(
            {
                "target": "B = C/8 step: time <= 1.4x open_clip's, memory <= 1/4 of it, N >= 8192",
                "measured": got,
                "met": all(r["time"] <= 1.4 and r["memory"] <= 0.25 for r in got.values()),
            }
        )
    for method, bound in ((B_EQ_C, 1.3), (RING, 1.0)):
        if FLOOR in loss and method in loss and 16384 in sizes:
            ratio = _ratios(loss, method, FLOOR, [16384])[16384]["time"]
            out.append(
                {
                    "target": f"InfoNCE loss machinery, {method}: time <= {bound}x the 6 C N d floor at N = 16384",
                    "measured": {16384: {"time": ratio}},
                    "met": ratio <= bound,
                }
            )
    for method in (SIGMOID, SIGMOID_RING):
        if BIDIR in sigmoid and method in sigmoid and big:
            got = _ratios(sigmoid, method, BIDIR, big)
            out.append(
                {
                    "target": f"{method}: time <= 1.0x, memory <= 1/8 of SigLipLoss bidir, N >= 8192",
                    "measured": got,
                    "met": all(r["time"] <= 1.0 and r["memory"] <= 0.125 for r in got.values()),
                }
            )
    return out


def _target_lines(goals: list[dict]) -> list[str]:
    lines = []
    for goal in goals:
        measured = "; ".join(
            f"N={n}: " + ", ".join(f"{k} {v:.2f}x" for k, v in m.items()) for n, m in goal["measured"].items()
        )
        lines.append(f"- {goal['target']}: **{'met' if goal['met'] else 'not met'}** ({measured})")
    return lines


def _part_table(part: str, rows_of: dict, sizes: list[int]) -> list[str]:
    base, floor = BASE[part], {r["n"]: r["time_s"] for r in rows_of.get(FLOOR, [])}
    over = "x floor | " if floor else ""
    lines = [
        f"**{TITLES[part]}**",
        "",
        f"| N | method | seconds | {over}x {base} | peak MiB | x {base} |",
        "|---:|---|---:|" + "---:|" * (3 + bool(floor)),
    ]
    for n in sizes:
        ref = _at(rows_of[base], n)
        for method, rows in rows_of.items():
            r = _at(rows, n)
            ratio = f"{r['time_s'] / floor[n]:.2f} | " if floor else ""
            lines.append(
                f"| {n} | {method} | {r['time_s']:.3f} | {ratio}{r['time_s'] / ref['time_s']:.2f} | "
                f"{r['peak_bytes'] / MIB:.1f} | {r['peak_bytes'] / ref['peak_bytes']:.3f} |"
            )
    return lines + [""]


def _meta_line(meta: dict) -> str:
    return (
        f"P = {meta['world']}, d = {meta['dim']}, {meta['dtype']}, T = {meta['stream_chunk']}, "
        f"median of {meta['repeats']} interleaved runs; device: {meta['device']}, torch {meta['torch']}, "
        f"{meta['backend']}. Load average (1 min) {meta['load_average_before']:.1f} before, "
        f"{meta['load_average_after']:.1f} after the run."
    )


def markdown(data: dict) -> str:
    meta, results = data["meta"], data["results"]
    lines = [
        _meta_line(meta),
        "",
        f"Command: `{meta['command']}`",
        "",
        "x floor: the time over the 6 C N d floor's (the gathered design's multiply-adds as plain mm), timed "
        "in the same part at the same N, interleaved. Memory: the peak of tensor storage the call allocated "
        "on the worst rank. Methods: `benchmarks/clip_step_losses.py`.",
        "",
    ]
    for part in ("step", "loss", "sigmoid"):
        if part in results:
            lines += _part_table(part, results[part], meta["sizes"])
    lines += ["**Targets** (ratios from this one interleaved run)", "", *_target_lines(targets(results, meta["sizes"]))]
    if "launches" in data:  # runs from before the kernels have no count
        lines += ["", launch_markdown(data["launches"], meta["world"], meta["dim"], meta["stream_chunk"])]
    return "\n".join(lines) + "\n"


def _axes_style(ax, what: str, xlabel: str = "global batch N") -> None:
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(what)
    ax.grid(True, which="both", alpha=0.3)


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    meta, results = data["meta"], data["results"]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8.4))
    panels = {"step": axes[0], "loss": axes[0], "sigmoid": axes[1]}
    styles = {"step": "-", "loss": "--", "sigmoid": "-"}
    for part, per_method in results.items():
        ax_t, ax_m = panels[part]
        for method, rows in per_method.items():
            ns, label = [r["n"] for r in rows], f"{part}: {method}"
            kw = dict(marker="o", color=COLOURS[method], label=label)
            ax_t.plot(ns, [r["time_s"] for r in rows], styles[part], **kw)
            if method not in FLOORS:
                ax_m.plot(ns, [r["peak_bytes"] / MIB for r in rows], styles[part], **kw)
    for (ax_t, ax_m), loss in zip(axes, ("InfoNCE", "sigmoid")):
        _axes_style(ax_t, f"{loss}: seconds (slowest rank, median)")
        _axes_style(ax_m, f"{loss}: peak MiB per rank")
        if ax_t.get_legend_handles_labels()[0]:
            ax_t.legend(fontsize=7)
    fig.suptitle(
        f"CLIP step and loss machinery, P = {meta['world']}, d = {meta['dim']}, float32, {meta['device']}", fontsize=9
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def memory_vs_p(runs: list[dict]) -> dict:
    """method -> {P: peak bytes}, from the --fixed-c runs (one N = C P each)."""
    table = {}
    for data in runs:
        for per_method in data["results"].values():
            for method, rows in per_method.items():
                if method not in FLOORS:
                    table.setdefault(method, {})[data["meta"]["world"]] = rows[0]["peak_bytes"]
    return table


def memory_markdown(runs: list[dict]) -> str:
    runs = sorted(runs, key=lambda d: d["meta"]["world"])
    worlds, table = [d["meta"]["world"] for d in runs], memory_vs_p(runs)
    c = runs[0]["meta"]["sizes"][0] // worlds[0]
    lines = [
        f"Peak MiB per rank at a fixed C = {c} (N = C P), d = {runs[0]['meta']['dim']}, float32, "
        f"T = {runs[0]['meta']['stream_chunk']}; device: {runs[0]['meta']['device']}. Only memory is read from "
        "these runs (P ranks share the machine's cores, so their times say nothing).",
        "",
        "Commands: " + "; ".join(f"`{d['meta']['command']}`" for d in runs),
        "",
        "| method | "
        + " | ".join(f"P = {p}" for p in worlds)
        + f" | P = {worlds[-1]} / P = {worlds[0]} | grew by, in C x d blocks |",
        "|---|" + "---:|" * (len(worlds) + 2),
    ]
    block = c * runs[0]["meta"]["dim"] * 4  # float32
    for method, by_p in table.items():
        first, last = by_p[worlds[0]], by_p[worlds[-1]]
        lines.append(
            f"| {method} | "
            + " | ".join(f"{by_p[p] / MIB:.1f}" for p in worlds)
            + f" | {last / first:.3f} | {(last - first) / block:.1f} |"
        )
    goals = []
    for method in (RING, SIGMOID_RING):
        if method in table and worlds[0] == 2 and worlds[-1] == 4:
            ratio = table[method][4] / table[method][2]
            goals.append(
                {
                    "target": f"{method}: peak memory within 10% from P = 2 to P = 4 at C = {c}",
                    "measured": {c * 4: {"P = 4 / P = 2": ratio}},
                    "met": abs(ratio - 1) <= 0.1,
                }
            )
    return "\n".join([*lines, "", "**Targets**", "", *_target_lines(goals)]) + "\n"


def plot_memory(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = memory_vs_p(runs)
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for method, by_p in table.items():
        ps = sorted(by_p)
        ax.plot(
            ps,
            [by_p[p] / MIB for p in ps],
            "--" if method in SIGMOIDS else "-",
            marker="o",
            color=COLOURS[method],
            label=method,
        )
    ax.set_yscale("log")
    ax.set_xticks(sorted({p for by_p in table.values() for p in by_p}))
    meta = runs[0]["meta"]
    ax.set_title(
        f"Peak memory per rank at C = {meta['sizes'][0] // meta['world']}, d = {meta['dim']} "
        "(solid: InfoNCE, dashed: sigmoid)",
        fontsize=9,
    )
    ax.set_xlabel("world size P (C fixed)")
    ax.set_ylabel("peak MiB per rank")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_report(json_path: Path) -> str:
    """Write <stem>.md and <stem>.png beside the JSON; return the Markdown."""
    data = json.loads(Path(json_path).read_text())
    text = markdown(data)
    Path(json_path).with_suffix(".md").write_text(text)
    plot(data, Path(json_path).with_suffix(".png"))
    return text


def write_memory_report(json_paths: list[Path], stem: Path) -> str:
    """<stem>.md and <stem>.png from the --fixed-c runs; return the Markdown."""
    runs = [json.loads(Path(p).read_text()) for p in json_paths]
    text = memory_markdown(runs)
    stem.with_suffix(".md").write_text(text)
    plot_memory(runs, stem.with_suffix(".png"))
    return text
