"""Output that reads the same in a terminal, a pipe and a notebook.

Width. rich decides a console's width by asking whether it writes to a terminal, and `FORCE_COLOR`
(which Jupyter's kernel sets, and the lesson subprocesses inherit) makes it answer yes, so a notebook
cell gets the layout of an 80-column terminal and its tables lose their cells to "...". Here the
width comes from what the output really is: `COLUMNS` when it is set, a live terminal's own width,
and 120 columns for everything captured (a notebook, a pipe, CI). Colour is rich's call as before, so
notebooks keep it.

Progress. A live bar redraws itself many times a second; captured, every redraw becomes a line.
`progress()` shows a bar only on rank 0 of a live terminal and otherwise prints one line at the end.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

import torch.distributed as dist
from rich import box
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

CAPTURED_WIDTH = 120
T = TypeVar("T")


def is_live_terminal() -> bool:
    """A person watching a terminal: stdout is a TTY (FORCE_COLOR does not count)."""
    try:
        return os.isatty(sys.stdout.fileno())
    except (AttributeError, OSError, ValueError):  # notebooks and captured streams have no fd
        return False


def output_width() -> int:
    """COLUMNS if set, else the live terminal's width, else CAPTURED_WIDTH."""
    columns = os.environ.get("COLUMNS", "")
    if columns.isdigit() and int(columns) > 0:
        return int(columns)
    if is_live_terminal():
        return shutil.get_terminal_size().columns
    return CAPTURED_WIDTH


console = Console(width=output_width())


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def print0(*objects: Any, **kwargs: Any) -> None:
    """Print with rich on rank 0 only (or always, outside a process group)."""
    if _is_rank0():
        console.print(*objects, **kwargs)


def error_line(message: str) -> Text:
    """'error: <message>', the message taken literally (no rich markup inside user text)."""
    return Text.assemble(("error: ", "bold red"), message)


def progress(items: Iterable[T], total: int | None = None, description: str = "") -> Iterator[T]:
    """Yield `items`; a live bar on rank 0 of a live terminal, else one final line on rank 0."""
    total = total if total is not None else (len(items) if hasattr(items, "__len__") else None)
    if not _is_rank0():
        yield from items
        return
    start = time.perf_counter()
    if is_live_terminal():
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*columns, console=console, transient=True) as bar:
            task = bar.add_task(description, total=total)
            for item in items:
                yield item
                bar.advance(task)
    else:
        yield from items
    done = f"{total}/{total}" if total is not None else "done"
    console.print(f"{description}: {done} in {time.perf_counter() - start:.1f} s", highlight=False)


def column_blocks(columns: int, cell_width: int, label_width: int, width: int | None = None) -> list[range]:
    """Split `columns` cells of `cell_width` characters (after a `label_width` label) into blocks
    that each fit the output width, so a wide grid is folded, never cut."""
    width = width if width is not None else console.width
    per_block = max(1, (width - label_width) // max(1, cell_width))
    return [range(start, min(start + per_block, columns)) for start in range(0, columns, per_block)]


def compact_table(title: str, columns: tuple[str, ...], caption: str = "") -> Table:
    """A table of numbers that fits a narrow terminal: a simple head, no edge padding, the first column
    names the row and is never broken (a narrow terminal wraps the headers instead), the others right-aligned."""
    table = Table(
        title=title,
        caption=caption or None,
        title_justify="left",
        caption_justify="left",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
    )
    for i, column in enumerate(columns):
        table.add_column(column, justify="left" if i == 0 else "right", overflow="fold", no_wrap=i == 0)
    return table


def rows_table(title: str, columns: tuple[str, ...], rows: list[tuple[str, ...]]) -> Table:
    """A `compact_table` of pre-formatted rows."""
    table = compact_table(title, columns)
    for row in rows:
        table.add_row(*row)
    return table
