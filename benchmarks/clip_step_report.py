"""Tables and plot for benchmarks/clip_step.py: every time with its ratio to the matmul floor, the
streamed step's time and memory against open_clip's recipe, and the three targets, met or not."""

from __future__ import annotations

import json
from pathlib import Path

OPEN_CLIP, B_EQ_C, B_C8, FLOOR = "open_clip recipe", "streamed, B = C", "streamed, B = C/8", "matmul floor"
MIB = 2 ** 20


def _at(rows: list[dict], n: int) -> dict | None:
    return next((r for r in rows if r["n"] == n), None)


def targets(results: dict, sizes: list[int]) -> list[dict]:
    """The three targets, each with the measured ratios and whether it holds."""
    step, loss, out = results.get("step", {}), results.get("loss", {}), []
    if OPEN_CLIP in step and B_EQ_C in step:
        ratios = [(n, _at(step[B_EQ_C], n)["time_s"] / _at(step[OPEN_CLIP], n)["time_s"],
                   _at(step[B_EQ_C], n)["peak_bytes"] / _at(step[OPEN_CLIP], n)["peak_bytes"]) for n in sizes]
        out.append({"target": "B = C step: time <= 1.0x open_clip's and less peak memory, every N",
                    "measured": {n: {"time": t, "memory": m} for n, t, m in ratios},
                    "met": all(t <= 1.0 and m < 1.0 for _, t, m in ratios)})
    if OPEN_CLIP in step and B_C8 in step:
        big = [n for n in sizes if n >= 8192]
        ratios = [(n, _at(step[B_C8], n)["time_s"] / _at(step[OPEN_CLIP], n)["time_s"],
                   _at(step[B_C8], n)["peak_bytes"] / _at(step[OPEN_CLIP], n)["peak_bytes"]) for n in big]
        if ratios:
            out.append({"target": "B = C/8 step: time <= 1.4x open_clip's, memory <= 1/4 of it, N >= 8192",
                        "measured": {n: {"time": t, "memory": m} for n, t, m in ratios},
                        "met": all(t <= 1.4 and m <= 0.25 for _, t, m in ratios)})
    if FLOOR in loss and B_EQ_C in loss and 16384 in sizes:
        ratio = _at(loss[B_EQ_C], 16384)["time_s"] / _at(loss[FLOOR], 16384)["time_s"]
        out.append({"target": "loss machinery (B = C): time <= 1.3x the matmul floor at N = 16384",
                    "measured": {16384: {"time": ratio}}, "met": ratio <= 1.3})
    return out


def markdown(data: dict) -> str:
    meta, results = data["meta"], data["results"]
    lines = [f"P = {meta['world']}, d = {meta['dim']}, {meta['dtype']}, T = {meta['stream_chunk']}, "
             f"tau = {meta['tau']}, median of {meta['repeats']} interleaved runs; device: {meta['device']}, "
             f"torch {meta['torch']}, {meta['backend']}."
             + (f" Load average (1 min) {meta['load_average_before']:.1f} before, {meta['load_average_after']:.1f} "
                "after the run." if "load_average_before" in meta else ""), "", f"Command: `{meta['command']}`", "",
             "x floor: the time over the matmul floor's (6 C N d multiply-adds as plain mm), timed in the same part "
             "at the same N, interleaved. "
             "Memory: the peak of tensor storage the call allocated on the worst rank.", ""]
    titles = {"step": "Whole training step (two-tower encoder 64 -> 256 -> d, AdamW)",
              "loss": "Loss machinery (C x d embeddings in, dL/dZ_local out)"}
    for part in ("step", "loss"):
        if part not in results:
            continue
        base = {r["n"]: r for r in results[part].get(OPEN_CLIP, [])}
        floor = {r["n"]: r["time_s"] for r in results[part].get(FLOOR, [])}
        lines += [f"**{titles[part]}**", "",
                  "| N | method | seconds | x floor | x open_clip | peak MiB | x open_clip |",
                  "|---:|---|---:|---:|---:|---:|---:|"]
        for n in meta["sizes"]:
            for method, rows in results[part].items():
                r = _at(rows, n)
                ref = base.get(n)
                ratio_t = f"{r['time_s'] / ref['time_s']:.2f}" if ref else ""
                ratio_m = f"{r['peak_bytes'] / ref['peak_bytes']:.3f}" if ref else ""
                over = f"{r['time_s'] / floor[n]:.2f}" if n in floor else ""
                lines.append(f"| {n} | {method} | {r['time_s']:.3f} | {over} | {ratio_t} | "
                             f"{r['peak_bytes'] / MIB:.1f} | {ratio_m} |")
        lines.append("")
    lines += ["**Targets** (ratios from this one interleaved run)", ""]
    for goal in targets(results, meta["sizes"]):
        measured = "; ".join(f"N={n}: " + ", ".join(f"{k} {v:.2f}x" for k, v in m.items())
                             for n, m in goal["measured"].items())
        lines.append(f"- {goal['target']}: **{'met' if goal['met'] else 'not met'}** ({measured})")
    return "\n".join(lines) + "\n"


def plot(data: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    meta, results = data["meta"], data["results"]
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(12, 4.8))
    styles = {"step": "-", "loss": "--"}
    colours = {OPEN_CLIP: "tab:red", B_EQ_C: "tab:blue", B_C8: "tab:green", FLOOR: "black"}
    for part, per_method in results.items():
        for method, rows in per_method.items():
            ns = [r["n"] for r in rows]
            label = f"{part}: {method}"
            ax_t.plot(ns, [r["time_s"] for r in rows], styles[part], marker="o", color=colours[method], label=label)
            if method != FLOOR:
                ax_m.plot(ns, [r["peak_bytes"] / MIB for r in rows], styles[part], marker="o",
                          color=colours[method], label=label)
    for ax, what in ((ax_t, "seconds (slowest rank, median)"), (ax_m, "peak MiB per rank")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("global batch N")
        ax.set_ylabel(what)
        ax.grid(True, which="both", alpha=0.3)
    ax_t.legend(fontsize=8)
    fig.suptitle(f"CLIP step, P = {meta['world']}, d = {meta['dim']}, float32, {meta['device']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(json_path: Path) -> str:
    """Write <stem>.md and <stem>.png beside the JSON; return the Markdown."""
    data = json.loads(Path(json_path).read_text())
    text = markdown(data)
    Path(json_path).with_suffix(".md").write_text(text)
    plot(data, Path(json_path).with_suffix(".png"))
    return text
