"""The tables lesson 08 prints, laid out to fit 80 columns whole (no cell is ever cut)."""

from __future__ import annotations

from fractions import Fraction

from rich.table import Table

from distlab.layer_split.tensor_parallel.runs import Outcome
from distlab.processes.console import compact_table


def mark(ok: bool) -> str:
    return "[green]yes[/]" if ok else "[bold red]no[/]"


def equality_table(title: str, outcomes: dict[str, Outcome]) -> Table:
    """One row per split run: output, step-1 gradients (the input's too), parameters and losses after
    the steps, each against the unsplit layer in one process."""
    out = compact_table(
        title,
        ("split", "output", "grads: max |a-r|", "params", "losses"),
        caption="every gradient (the input's too) cut as the rank's parameters are; every column "
        "allclose at float64's rtol 1e-10, atol 1e-12",
    )
    for name, o in outcomes.items():
        grads = o.against["gradients"]
        out.add_row(
            name,
            mark(o.against["output"].ok),
            f"{grads.max_abs:.1e} {mark(grads.ok)}",
            mark(o.against["parameters"].ok),
            mark(o.against["losses"].ok),
        )
    return out


def bytes_table(title: str, rows: list[tuple[str, dict, dict]]) -> Table:
    """(name, counted, formula) by (direction, collective): the bytes one rank sent, against the formula."""
    out = compact_table(title, ("split", "direction", "collective", "counted B", "formula B", "="))
    for name, counted, formula in rows:
        for key in sorted(set(counted) | set(formula)):
            got, want = counted.get(key, Fraction(0)), formula.get(key, Fraction(0))
            out.add_row(name, key[0], COLLECTIVE[key[1]], _bytes(got), _bytes(want), mark(got == want))
            name = ""
    return out


COLLECTIVE = {"all_reduce": "all-reduce", "all_gather": "all-gather", "reduce_scatter": "reduce-scatter"}


def _bytes(value: Fraction) -> str:
    return f"{int(value):,}" if value.denominator == 1 else f"{float(value):,.1f}"
