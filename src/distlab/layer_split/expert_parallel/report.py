"""Lesson 10's tables: where the tokens went, the load per expert, the bytes per rank, the drops per gamma.

Each is a line that says what it shows and a `compact_table` of numbers under it (the line is not the
table's title: a title wider than its table would wrap), so they read in 80 columns.
"""

from __future__ import annotations

from rich.console import Group
from rich.text import Text

from distlab.processes.console import rows_table

BYTES_COLUMNS = ("counts", "dispatch", "combine", "combine bwd", "dispatch bwd")  # cost.expected_bytes' order


def _shown(line: str, columns: tuple[str, ...], rows: list[tuple]) -> Group:
    return Group(Text(line), rows_table("", columns, [tuple(map(str, row)) for row in rows]))


def owner_table(to_owner: list[list[int]]) -> Group:
    """The routing matrix between ranks: tokens kept, from rank s (rows) to the experts of rank q."""
    rows = [(f"rank {s}", *row) for s, row in enumerate(to_owner)]
    return _shown(
        "Tokens kept, from rank s (rows) to the experts of rank q (columns)", ("", *map(str, range(len(rows)))), rows
    )


def load_table(routed: list[int], kept: list[int], capacity: int | None, gamma: float) -> Group:
    """Per expert: the tokens that chose it and those it kept."""
    line = f"Per expert, capacity {capacity} = ceil(gamma kappa N seq / E) at gamma {gamma:g}"
    return _shown(line, ("expert", *map(str, range(len(routed)))), [("chose it", *routed), ("kept", *kept)])


def bytes_table(counted: list[list[int]], formula: list[list[int]], row_bytes: int) -> Group:
    """Per rank, the bytes it sent in each phase, counted, and whether they equal the formula's."""
    rows = [
        (f"rank {s}", *(f"{b:,}" for b in sent), "yes" if sent == formula[s] else "NO")
        for s, sent in enumerate(counted)
    ]
    line = f"Bytes each rank sent in one step, counted (a token's row: d e = {row_bytes} B)"
    return _shown(line, ("", *BYTES_COLUMNS, "= formula"), rows)


def drops_table(drops: list[tuple[float, int, int]], choices: int) -> Group:
    """(gamma, capacity, choices dropped) per capacity factor."""
    return _shown(f"Choices dropped, of kappa N seq = {choices}", ("gamma", "capacity", "dropped"), drops)


def statistics_table(found: dict[str, tuple[float, float, float]], one_process: float) -> Group:
    """L_aux (the ranks' mean) and its gradient's distance from one process's, per choice of statistics:
    found[statistics] = (L_aux, relative difference, cosine)."""
    names = {"local": "phi: each rank's own", "global": "phi: the step's (exchanged)"}
    rows = [(names[k], f"{aux:.10f}", f"{rel:.1e}", f"{cos:.6f}") for k, (aux, rel, cos) in found.items()]
    rows.append(("one process, whole batch", f"{one_process:.10f}", "", ""))
    line = "L_aux (the ranks' mean, as DDP's) and its gradient against one process's"
    return _shown(line, ("", "L_aux", "grad rel diff", "cosine"), rows)


def capacity_table(facts: dict[str, tuple], reference: tuple[int, int]) -> Group:
    """Per capacity rule: (capacity, choices dropped, dropped choices that differ from the reference's,
    output = the reference's, dropped per rank); reference = (its capacity, its choices dropped)."""
    names = {"rank": "GShard, per rank", "global": "global order"}
    rows = [
        (names[k], most, dropped, ", ".join(map(str, per_rank)), other, "yes" if same else "no")
        for k, (most, dropped, other, same, per_rank) in facts.items()
    ]
    rows.append(("one process", *reference, "", "", ""))
    line = "Capacity = ceil(gamma kappa tokens / E); tokens: a rank's C seq or all N seq"
    header = ("rule", "capacity", "dropped", "per rank", "not ref's", "out = ref")
    return _shown(line, header, rows)


def training_table(means: dict[str, list[float]], last: int, spread: int) -> Group:
    """Per choice of statistics, the means over the last `last` steps of: L_task, L_aux, the step's load
    max/mean, each rank's own (mean over ranks). `spread`: E / kappa, the max/mean of a load all on kappa."""
    rows = [(name, *(f"{v:.3f}" for v in values)) for name, values in means.items()]
    line = f"Means of the last {last} steps (load max/mean: 1 even, {spread} = E/kappa all on kappa)"
    return _shown(line, ("statistics", "L_task", "L_aux", "load max/mean", "a rank's own"), rows)
