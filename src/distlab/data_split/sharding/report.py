"""The tables lesson 07 prints, laid out to fit 80 columns whole.

A run against another is `distlab.proof.compare.against`: step 1's gradients, every parameter after the last
step, every AdamW state (m, v, the step count) and every step's loss, each part one `Comparison`.
"""

from __future__ import annotations

from distlab.processes.console import rows_table
from distlab.proof.compare import Comparison, all_ok


def kib(n: int) -> str:
    return f"{n / 1024:,.2f}"


def agreement_table(title: str, rows: dict[str, tuple[str, dict[str, Comparison]]]):
    """One row per run: what it is compared with, the worst relative error of each part, all equal."""
    return rows_table(
        title,
        ("run", "against", "params", "grads", "AdamW m, v, t", "equal"),
        [
            (
                name,
                what,
                f"{parts['parameters'].max_rel:.1e}",
                f"{parts['gradients'].max_rel:.1e}",
                f"{parts['optimizer states'].max_rel:.1e}",
                "[green]yes[/]" if all_ok(parts.values()) else "[bold red]no[/]",
            )
            for name, (what, parts) in rows.items()
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
