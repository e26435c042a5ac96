"""When each action of a schedule runs: the unit-time grid, and the bubble and memory read off it.

Every dependency is one of three (vP stages, micro-batch i):
    F(p, i) after F(p-1, i)                 its input
    I(p, i) after F(p, i) and I(p+1, i)     its saved activations, and the gradient of its output
    W(p, i) after I(p, i)                   the gradient of its output, kept by I
`simulate` places each action at its earliest tick under those dependencies, one action at a time
per rank and in the rank's own order, and returns a grid of P rows and one column per tick whose
empty cells are the bubble.
Costs in ticks: a forward t_F, an input gradient t_I, a weight gradient t_W; an unsplit backward
t_I + t_W. The default t_F = t_I = t_W = 1 is the zero-bubble paper's (a backward costs about twice a forward).
Transfers are free here; the runner pays for them.

    bubble fraction   = idle cells / (P x ticks)
    peak in flight(r) = most (stage, micro-batch) pairs rank r holds activations for: from its F
                        until its unsplit I, or its W (a split I still needs them for W)

The closed forms, proved against these functions in tests/test_schedules.py for P <= 6, M <= 13:
    GPipe, 1F1B                     (P - 1) / (M + P - 1)            any t_F, t_I, t_W
    interleaved 1F1B, v stages      (P - 1) / (v M + P - 1)          P | M, t_F = 1, t_I + t_W = 2
    ZB-H1                           (P - 1) / (3 M + P - 1)          M >= P, t_F = t_I = t_W = 1
    in flight: GPipe M; 1F1B min(M, P - r); ZB-H1 min(M, P); interleaved min(v M, (v - 1) P + 2 (P - r - 1) + 1)
"""

from __future__ import annotations

from dataclasses import dataclass

from rich.console import Group
from rich.table import Table
from rich.text import Text

from distlab.model_split.schedules import Action, Schedule, check_schedule, num_stages, split_backward
from distlab.processes.console import column_blocks


def dependencies(action: Action, stages: int) -> list[Action]:
    """The actions that must finish before `action` can start (`stages` = vP)."""
    p, i = action.stage, action.microbatch
    if action.kind == "F":
        return [Action("F", i, p - 1)] if p > 0 else []
    if action.kind == "I":
        return [Action("F", i, p)] + ([Action("I", i, p + 1)] if p < stages - 1 else [])
    return [Action("I", i, p)]


@dataclass(frozen=True)
class Timing:
    """Where `simulate` put every action: start and finish ticks, and the grid, P rows of ticks (None = idle)."""

    start: dict[Action, int]
    finish: dict[Action, int]
    grid: list[list[Action | None]]

    @property
    def ticks(self) -> int:
        return len(self.grid[0])

    def bubble_fraction(self) -> float:
        """Idle cells over all cells: the share of the P x ticks rank-ticks nobody computes."""
        idle = sum(cell is None for row in self.grid for cell in row)
        return idle / (len(self.grid) * self.ticks)


def durations(schedule: Schedule, t_f: int = 1, t_i: int = 1, t_w: int = 1) -> dict[Action, int]:
    split = split_backward(schedule)
    cost = {"F": t_f, "W": t_w}
    return {
        a: cost.get(a.kind, t_i if (a.stage, a.microbatch) in split else t_i + t_w) for order in schedule for a in order
    }


def simulate(schedule: Schedule, t_f: int = 1, t_i: int = 1, t_w: int = 1) -> Timing:
    """Place every action at its earliest tick. Raises ValueError when the ranks' orders contradict
    the dependencies: the ranks would wait for each other forever, a deadlock in the schedule."""
    check_schedule(schedule)
    stages, took = num_stages(schedule), durations(schedule, t_f, t_i, t_w)
    start: dict[Action, int] = {}
    finish: dict[Action, int] = {}
    next_index, free_at = [0] * len(schedule), [0] * len(schedule)
    progress = True
    while progress:
        progress = False
        for r, order in enumerate(schedule):
            while next_index[r] < len(order):
                action = order[next_index[r]]
                deps = dependencies(action, stages)
                if any(d not in finish for d in deps):
                    break  # wait for another rank; come back on the next sweep
                start[action] = max([free_at[r], *(finish[d] for d in deps)])
                finish[action] = free_at[r] = start[action] + took[action]
                next_index[r] += 1
                progress = True
    stuck = [
        f"rank {r} at {order[i].label}" for r, (order, i) in enumerate(zip(schedule, next_index)) if i < len(order)
    ]
    if stuck:
        raise ValueError("the schedule deadlocks: " + ", ".join(stuck) + " wait forever")
    grid: list[list[Action | None]] = [[None] * max(free_at) for _ in schedule]
    for r, order in enumerate(schedule):
        for action in order:
            for t in range(start[action], finish[action]):
                grid[r][t] = action
    return Timing(start, finish, grid)


def peak_in_flight(schedule: Schedule) -> list[int]:
    """Per rank: the most (stage, micro-batch) pairs forwarded and not yet released, in its order."""
    split = split_backward(schedule)
    peaks = []
    for order in schedule:
        held = peak = 0
        for a in order:
            releases = a.kind == "W" or (a.kind == "I" and (a.stage, a.microbatch) not in split)
            held += 1 if a.kind == "F" else -1 if releases else 0
            peak = max(peak, held)
        peaks.append(peak)
    return peaks


STYLES = {"F": "cyan", "I": "magenta", "W": "green"}


def _cell(action: Action | None, text: str) -> str:
    return f"[{STYLES[action.kind]}]{text}[/]" if action else f"[dim]{text}[/]"


def _compact_row(label: str, row: list[Action | None], first_stage: int, stretch: int) -> Text:
    """One rank's ticks as characters, runs of one kind in one style (a short, plain output)."""
    line = Text(label, style="bold")
    for a in row:
        char = "." if a is None else a.kind if a.stage == first_stage else a.kind.lower()
        line.append(char * stretch, style=STYLES[a.kind] if a else "dim")
    return line


def render(timing: Timing, title: str = "", width: int | None = None, compact: bool = False, stretch: int = 1) -> Group:
    """The grid as text, one row per rank and one column per tick, '.' where a rank idles; folded
    into blocks of ticks that fit the output width (every tick shown, no row wrapped). Cells name
    the micro-batch (F3), and the stage too when a rank holds several (2F3: stage 2). `compact`:
    the kind alone, lower case on a rank's second and later stages, `stretch` characters per tick
    (2 for a one-stage-per-rank grid beside grids of half-size stages: one time axis for all)."""
    label = len(f"rank {len(timing.grid) - 1}") + 1
    parts: list = [title] if title else []
    if compact:
        first = [min((a.stage for a in row if a), default=0) for row in timing.grid]
        for k, block in enumerate(column_blocks(timing.ticks, stretch, label, width)):
            parts += [Text(f"t={block.start}")] if k else []
            parts += [
                _compact_row(f"rank {r}".ljust(label), row[block.start : block.stop], first[r], stretch)
                for r, row in enumerate(timing.grid)
            ]
        return Group(*parts)
    multi = len({a.stage for a in timing.start}) > len(timing.grid)
    text = [[(a.label if multi else str(a)) if a else "." for a in row] for row in timing.grid]
    cell = max(len(c) for row in text for c in row)
    for block in column_blocks(timing.ticks, cell + 1, label, width):
        table = Table(box=None, show_edge=False, pad_edge=False, padding=(0, 0, 0, 1), show_header=False)
        table.add_column(justify="left", style="bold", no_wrap=True, min_width=label - 1)
        for _ in block:
            table.add_column(justify="center", no_wrap=True, min_width=cell, max_width=cell)
        table.add_row(f"t={block.start}", *("" for _ in block))
        for r, row in enumerate(timing.grid):
            table.add_row(f"rank {r}", *(_cell(row[t], text[r][t]) for t in block))
        parts.append(table)
    return Group(*parts)
