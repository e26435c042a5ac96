"""The comparisons and tables lesson 07 prints, laid out to fit 80 columns whole.

`against(reference, trained)` compares every parameter, the last step's gradients and every AdamW
state (m, v, the step count) of a run with another, at float64's tolerances unless told otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

from distlab.compare import compare
from distlab.console import rows_table
from distlab.sharding.problem import Trained

STATE_KEYS = ("exp_avg", "exp_avg_sq", "step")


@dataclass(frozen=True)
class Agreement:
    params: float  # the largest max |a - r| / max |r| over the parameters
    grads: float
    states: float
    ok: bool  # every tensor allclose


def _worst(rows) -> float:
    return max(row.max_rel for row in rows)


def against(ref: Trained, got: Trained, rtol: float | None = None, atol: float | None = None) -> Agreement:
    params, grads = compare(ref.params, got.params, rtol, atol), compare(ref.grads, got.grads, rtol, atol)
    states = [
        row
        for name in ref.states
        for row in compare(
            {k: ref.states[name][k] for k in STATE_KEYS}, {k: got.states[name][k] for k in STATE_KEYS}, rtol, atol
        )
    ]
    ok = all(row.ok for row in params + grads + states)
    return Agreement(_worst(params), _worst(grads), _worst(states), ok)


def kib(n: int) -> str:
    return f"{n / 1024:,.2f}"


def agreement_table(title: str, rows: dict[str, tuple[str, Agreement]]):
    """One row per run: what it is compared with, the worst relative error of each kind, ok."""
    return rows_table(
        title,
        ("run", "against", "params", "grads", "AdamW m, v, t", "equal"),
        [
            (
                name,
                what,
                f"{a.params:.1e}",
                f"{a.grads:.1e}",
                f"{a.states:.1e}",
                "[green]yes[/]" if a.ok else "[bold red]no[/]",
            )
            for name, (what, a) in rows.items()
        ],
    )


def holds_table(title: str, rows: list[tuple[str, str, int, int, int, int]]):
    """item, formula, float64 formula / measured, mixed precision formula / measured (KiB)."""
    return rows_table(
        title,
        ("item", "formula", "f64 formula", "measured", "bf16+f32", "measured"),
        [
            (item, text, kib(a) if a or b else "-", kib(b) if a or b else "-", kib(c), kib(d))
            for item, text, a, b, c, d in rows
        ],
    )


def memory_table(title: str, rows: list[tuple[str, int, int, int, int]]):
    """stage, held formula, held measured (by storage), PeakMemory's live and peak (KiB)."""
    return rows_table(
        title,
        ("stage", "formula", "held", "live", "peak"),
        [(name, kib(f), kib(h), kib(live), kib(peak) if peak >= 0 else "-") for name, f, h, live, peak in rows],
    )


def bytes_table(title: str, rows: list[tuple[str, str, int, int, float]]):
    """stage, formula, formula's bytes, counted bytes, ratio to DDP's."""
    return rows_table(
        title,
        ("stage", "formula", "bytes", "counted", "x DDP"),
        [(name, text, f"{f:,}", f"{c:,}", f"{ratio:.3f}") for name, text, f, c, ratio in rows],
    )
