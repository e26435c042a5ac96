"""What the pipeline lessons print: each run against the unsplit model, orders side by side, and the
measured timelines of a step (on the real CPU or the emulated device) with their idle share.

Each rank holds only its own stages' gradients and parameters, so each compares its share with the
reference's and the rows are gathered to every rank; a verdict is then the same everywhere. One
summary line per run (the largest error over every tensor of every stage) keeps a 16-layer model's
check readable; lesson 01 prints the per-tensor version.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from rich.table import Table

from distlab.model_split.runner import PipelineStep
from distlab.model_split.schedules import Schedule
from distlab.model_split.training import PipelineRun, train
from distlab.processes.console import print0
from distlab.proof.compare import Comparison, compare, comparison_table, tolerances
from distlab.proof.timeline import Span, busy_fractions, idle_fraction, max_concurrency
from distlab.proof.timeline import render as render_spans
from distlab.proof.training import Run


def gathered(value: Any) -> list[Any]:
    """Every rank's `value`, in rank order, on every rank (a collective)."""
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _rows(run: Run, ref: Run, names) -> tuple[list, list]:
    return (
        compare({n: ref.first_grads[n] for n in names}, run.first_grads),
        compare({n: ref.params[n] for n in names}, run.params),
    )


def per_tensor(run: PipelineRun, ref: Run, dtype: torch.dtype) -> tuple[list[Table], bool]:
    """Lesson 01's readout: one table of every tensor's gradient, one of every parameter, and
    whether every tensor and every step's loss matched (the same on all ranks)."""
    every = gathered(_rows(run, ref, run.first_grads.keys()))
    rtol, atol = tolerances(dtype)
    caption = f"allclose with rtol {rtol:g}, atol {atol:g}"
    tables = [
        comparison_table([row for rank in every for row in rank[k]], title, caption=caption)
        for k, title in enumerate(
            ("gradients after step 1: split vs unsplit", f"parameters after {len(ref.losses)} steps: split vs unsplit")
        )
    ]
    rows = [row for rank in every for part in rank for row in part]
    losses_ok = torch.allclose(torch.tensor(run.losses), torch.tensor(ref.losses), rtol=rtol, atol=atol)
    return tables, all(r.ok for r in rows) and losses_ok


def check_runs(
    runs: dict[str, PipelineRun], ref: Run | dict[str, Run], dtype: torch.dtype, title: str = ""
) -> tuple[Table, bool]:
    """A table with one row per named run, and whether every run matched (identical on all ranks).
    `ref` is the reference for every run, or a dict with one per run name. A collective: call it
    on every rank with the same run names."""
    refs = ref if isinstance(ref, dict) else {name: ref for name in runs}
    every = gathered({name: _rows(run, refs[name], run.first_grads.keys()) for name, run in runs.items()})
    rtol, atol = tolerances(dtype)
    steps = len(next(iter(refs.values())).losses)
    table = Table(
        title=title or "every stage against the unsplit model on the whole batch",
        title_justify="left",
        caption_justify="left",
        caption=f"max |a-r| over every tensor of every stage: gradients after step 1, parameters "
        f"after step {steps}, every step's loss; allclose with rtol {rtol:g}, atol {atol:g}",
    )
    for column in ("run", "grads", "params", "losses", "allclose"):
        table.add_column(column, justify="left" if column == "run" else "right", overflow="fold")
    every_ok = True
    for name, run in runs.items():
        grads = [row for rank in every for row in rank[name][0]]
        params = [row for rank in every for row in rank[name][1]]
        got, want = torch.tensor(run.losses), torch.tensor(refs[name].losses)
        ok = all(r.ok for r in grads + params) and torch.allclose(got, want, rtol=rtol, atol=atol)
        every_ok &= ok
        table.add_row(
            name,
            _worst(grads),
            _worst(params),
            f"{(got - want).abs().max().item():.2e}",
            "[green]yes[/]" if ok else "[red]no[/]",
            style=None if ok else "bold",
        )
    return table, every_ok


def _worst(rows: list[Comparison]) -> str:
    return f"{max(r.max_abs for r in rows):.2e}"


def orders_table(orders: dict[str, Schedule], title: str, labels: bool = False) -> Table:
    """Per rank, one column per named order; a cell that differs from the first column is yellow."""
    table = Table(title=title, title_justify="left")
    table.add_column("rank", justify="right", overflow="fold")
    for name in orders:
        table.add_column(name, overflow="fold")
    first = next(iter(orders.values()))
    for r in range(len(first)):
        cells = []
        for k, order in enumerate(orders.values()):
            text = " ".join(a.label if labels else str(a) for a in order[r])
            cells.append(text if k == 0 or order[r] == first[r] else f"[yellow]{text}[/]")
        table.add_row(str(r), *cells)
    return table


def show_measured(title: str, runs: dict[str, list[Span]], world_size: int, step: int) -> dict:
    """Print the measured timeline of step `step` of each labelled run ("real CPU", "emulated
    device ...") with what it shows: the most ranks computing at once, each rank's busy share, and
    the idle share (the measured bubble). Returns those figures per label."""
    out = {}
    for label, spans in runs.items():
        last = [s for s in spans if s.step == step]
        busy = busy_fractions(last, world_size)
        out[label] = dict(
            concurrency=max_concurrency(last),
            busy=busy,
            idle=idle_fraction(last, world_size),
            step_ms=1e3 * (max(s.end for s in last) - min(s.start for s in last)),
            spans=[vars(s) for s in last],
        )
        print0(f"\n[bold]{title}, measured on the {label}[/]:")
        print0(render_spans(last, world_size))
        print0(
            f"most ranks computing at one instant: {out[label]['concurrency']}; busy per rank: "
            + ", ".join(f"{b:.0%}" for b in busy)
            + f"; idle share (measured bubble): {out[label]['idle']:.3f}"
        )
    return out


def idle_against_grid(idle: float, world_size: int, micro_batches: int) -> str:
    """The emulated step's measured idle share beside its grid's (P-1)/(M+P-1), as a ratio when the grid
    has a bubble; at P = 1 it has none (one stage never waits), and a ratio to 0 means nothing."""
    world, m = world_size, micro_batches
    formula = (world - 1) / (m + world - 1)
    line = f"emulated device: measured idle share {idle:.3f} against the grid's (P-1)/(M+P-1) = {formula:.3f} "
    if formula == 0:
        return line + "(P = 1: one stage, no bubble; the clock's wake-ups are what was measured)"
    return line + f"({idle / formula:.2f}x; the messages and the clock's wake-ups are the difference)"


def show_timelines(rt, cfg, schedule: Schedule, name: str, real: PipelineRun, ref: Run, verdict) -> dict:
    """`name`'s last step measured on the real CPU (`real`'s spans) and, with `cfg.emulate_ms` > 0, run
    again on the emulated device (each layer-pass a fixed time, slept: `distlab/proof/emulate.py`), whose
    gradients must still be `ref`'s (a check). Prints both timelines and the emulated idle share against
    the grid's (P-1)/(M+P-1) (GPipe's and 1F1B's alike); returns `show_measured`'s figures."""
    world, m = rt.world_size, cfg.micro_batches
    spans = {"real CPU": real.spans}
    if cfg.emulate_ms:
        emulated = train(rt, cfg, PipelineStep(rt, cfg, schedule))
        table, matched = check_runs({f"{name} on the emulated device": emulated}, ref, cfg.dtype)
        print0(table)
        verdict.check(f"on the emulated device {name} still computes the unsplit model's gradients", matched)
        spans[f"emulated device, {cfg.emulate_ms:g} ms per layer-pass"] = emulated.spans
    measured = show_measured(f"{name}'s last step", spans, world, cfg.steps - 1)
    if cfg.emulate_ms:
        print0(idle_against_grid(list(measured.values())[-1]["idle"], world, m))
    return measured
