"""The tables lesson 06 prints, laid out to fit 80 columns whole (no cell is ever cut).

Gradients are summed up by `distlab.proof.compare.compare_whole`: the largest relative error, the norm
ratio ||g|| / ||r|| (a pure scaling bug shows as a clean 1/P), and allclose at the dtype's tolerance.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from rich.table import Table

from distlab.processes.console import compact_table
from distlab.proof.compare import Comparison
from distlab.proof.memory import MIB

Grads = Mapping[str, torch.Tensor]


def _mark(ok: bool, expected: bool = True) -> str:
    text = "yes" if ok else "no"
    return f"[green]{text}[/]" if ok == expected else f"[bold red]{text}[/]"


AFTER = {
    "all_reduce": "sum_q x_q",
    "all_gather": "x_0, ..., x_{P-1}",
    "reduce_scatter": "chunk r of sum_q x_q",
    "broadcast": "x_0",
}


def semantics_table(rows: list) -> Table:
    """What rank r ends with, whether torch's and the ring by hand's results equal one process's, and
    whether the ring by hand equals the library's (`distlab.comm.ring.Ring`: result and bytes)."""
    table = compact_table(
        "What each collective computes, against one process",
        ("collective", "rank r ends with", "max |err|", "torch", "by hand", "= Ring"),
    )
    for row in rows:
        marks = (_mark(row.ok), _mark(row.ring_ok), _mark(row.same_as_library))
        table.add_row(row.name, AFTER[row.name], f"{row.max_err:.1e}", *marks)
    return table


def cost_table(rows: list) -> Table:
    """Bytes against the ring formula, and torch's time against the bytes, both relative to
    all_gather's (`measure.CollectiveRow`s of one rank)."""
    base = next(row for row in rows if row.name == "all_gather")
    table = compact_table(
        f"Bytes one rank sends, and time, for a {rows[0].full_bytes / MIB:.2f} MiB tensor",
        ("collective", "ring", "MiB", "counted", "ms", "t / t_ag", "b / b_ag"),
        caption="ring: the formula, in units of the tensor's bytes; MiB: what it gives; counted: what "
        "rank 0 sent in the ring by hand (in the broadcast the last rank sends none); t_ag, b_ag: "
        "all_gather's time and bytes. gloo picks its own algorithms: its reduce_scatter is an "
        "all_reduce of a copy",
    )
    for row in rows:
        sized = base.formula_bytes > 0  # at P = 1 nothing is sent and the ratios mean nothing
        table.add_row(
            row.name,
            row.formula.replace(" x bytes", ""),
            f"{row.formula_bytes / MIB:.2f}",
            f"{row.counted_bytes / MIB:.2f}",
            f"{row.seconds * 1e3:.1f}",
            f"{row.seconds / base.seconds:.2f}" if sized else "-",
            f"{row.formula_bytes / base.formula_bytes:.2f}" if sized else "-",
        )
    return table


def gradient_table(rows: list[tuple[str, str, Comparison, bool]], title: str) -> Table:
    """(what ran, compared with, its check, whether allclose is the claim)."""
    table = compact_table(title, ("run", "against", "max rel err", "|g| / |ref|", "allclose"))
    for name, against, check, expected in rows:
        table.add_row(name, against, f"{check.max_rel:.1e}", f"{check.norm_ratio:.6f}", _mark(check.ok, expected))
    return table


def timing_table(times: dict, baseline: str) -> Table:
    """Step and backward time per strategy (`overlap.StepSeconds`), and what the step took beyond
    `baseline`'s (the communication left exposed)."""
    table = compact_table(
        "One step: forward, backward, gradient sync (median, slowest rank)",
        ("strategy", "step ms", "backward ms", "exposed ms"),
        caption="exposed: step time beyond compute only's; DDP waits for its all-reduces inside "
        "backward, our hooks in wait() after it",
    )
    for name, t in times.items():
        extra = "" if name == baseline else f"{(t.step_s - times[baseline].step_s) * 1e3:+.1f}"
        table.add_row(name, f"{t.step_s * 1e3:.1f}", f"{t.backward_s * 1e3:.1f}", extra)
    return table


def timeline_table(launched: list[float], done: list[float], sizes: list[int], backward_end: float) -> Table:
    """Per bucket: its size, and when its all-reduce was launched and completed (ms from backward's start)."""
    table = compact_table(
        "One step's buckets, ms from backward's start",
        ("bucket", "MiB", "launched", "completed", "in backward"),
        caption=f"backward ended at {backward_end:.1f} ms",
    )
    for i, (start, end, size) in enumerate(zip(launched, done, sizes)):
        table.add_row(
            str(i), f"{size / MIB:.2f}", f"{start:.1f}", f"{end:.1f}", "yes" if start < backward_end else "no"
        )
    return table
