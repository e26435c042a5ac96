"""Pipeline schedules as data: who does what, in which order, and what that costs.

A schedule for P stages and M micro-batches is, per rank s, an ordered list of actions: F(i) runs
the forward of micro-batch i through stage s, B(i) its backward. Three schedules:

- naive (lesson 01): M = 1, one forward down and one backward up.
- GPipe: every forward, then every backward (F0 .. F(M-1), B0 .. B(M-1)). Micro-batches are
  independent, so the backward order is free; we use PyTorch's (first in, first out). Seed 004's
  reverse loop "required by the dependency chain (LIFO)" is one valid choice, not a requirement.
- 1F1B: warm-up with min(P - s - 1, M) forwards, then alternate one forward and one backward, then
  cool down with the remaining backwards. A stage starts a backward as soon as it can, so it holds
  at most P - s micro-batches' activations instead of M.

Every dependency is of one kind: F(i) on stage s needs F(i) on s-1 (its input); B(i) on s needs B(i)
on s+1 (the gradient of its output) and F(i) on s (its saved activations). `simulate` places each
action at its earliest tick under those dependencies, one action per rank per tick and in the rank's
own order, so it yields a P x T grid whose empty cells are the bubble. All the figures the lessons
claim are computed from that data, never from a formula:

    bubble fraction   = idle cells / (P * T)       (the tests check it is (P-1)/(M+P-1) for both
                                                    GPipe and 1F1B: 1F1B does NOT shrink the bubble,
                                                    seed 004's section 4.2 says it does)
    peak in flight(s) = max over rank s's order of #{i : F(i) done, B(i) not yet}
                      = M for GPipe, min(M, P - s) for 1F1B: what 1F1B actually buys is memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from rich.table import Table


@dataclass(frozen=True)
class Action:
    """One unit of work on one stage: kind 'F' (forward) or 'B' (backward) of micro-batch i."""

    kind: str
    microbatch: int

    def __post_init__(self) -> None:
        if self.kind not in ("F", "B"):
            raise ValueError(f"an action is 'F' or 'B', got {self.kind!r}")

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}"


Schedule = list[list[Action]]  # schedule[s] = rank s's actions, in execution order


def _check(num_stages: int, num_microbatches: int) -> None:
    if num_stages < 1:
        raise ValueError(f"need at least one stage, got P={num_stages}")
    if num_microbatches < 1:
        raise ValueError(f"need at least one micro-batch, got M={num_microbatches}")


def gpipe(num_stages: int, num_microbatches: int) -> Schedule:
    """All forwards, then all backwards, on every rank."""
    _check(num_stages, num_microbatches)
    order = [Action("F", i) for i in range(num_microbatches)]
    order += [Action("B", i) for i in range(num_microbatches)]
    return [list(order) for _ in range(num_stages)]


def naive(num_stages: int) -> Schedule:
    """Lesson 01's schedule: the whole batch as one micro-batch."""
    return gpipe(num_stages, 1)


def one_f_one_b(num_stages: int, num_microbatches: int) -> Schedule:
    """Warm-up forwards, steady one-forward-one-backward, cool-down backwards."""
    _check(num_stages, num_microbatches)
    schedule = []
    for s in range(num_stages):
        warmup = min(num_stages - s - 1, num_microbatches)
        order = [Action("F", i) for i in range(warmup)]
        for k in range(num_microbatches - warmup):  # steady state: F of the newest, B of the oldest
            order += [Action("F", warmup + k), Action("B", k)]
        order += [Action("B", i) for i in range(num_microbatches - warmup, num_microbatches)]
        schedule.append(order)
    return schedule


SCHEDULE_NAMES = ("naive", "gpipe", "1f1b")


def make_schedule(name: str, num_stages: int, num_microbatches: int) -> Schedule:
    """The named schedule for P stages and M micro-batches, with a clear error for bad input."""
    if name not in SCHEDULE_NAMES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {list(SCHEDULE_NAMES)}")
    if name == "naive":
        if num_microbatches != 1:
            raise ValueError(f"the naive schedule runs the batch as one micro-batch, got M={num_microbatches}")
        return naive(num_stages)
    return gpipe(num_stages, num_microbatches) if name == "gpipe" else one_f_one_b(num_stages, num_microbatches)


def num_microbatches(schedule: Schedule) -> int:
    """M, checking that every rank does F(i) and B(i) exactly once for each i in 0..M-1."""
    m = sum(a.kind == "F" for a in schedule[0])
    expected = sorted([Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)],
                      key=str)
    for s, order in enumerate(schedule):
        if sorted(order, key=str) != expected:
            raise ValueError(f"rank {s} must run F(i) and B(i) once for each of the {m} micro-batches")
    return m


def dependencies(stage: int, action: Action, num_stages: int) -> list[tuple[int, Action]]:
    """The (stage, action) pairs that must finish before `action` can start on `stage`."""
    i = action.microbatch
    if action.kind == "F":
        return [(stage - 1, Action("F", i))] if stage > 0 else []
    deps = [(stage, Action("F", i))]
    if stage < num_stages - 1:
        deps.append((stage + 1, Action("B", i)))
    return deps


@dataclass(frozen=True)
class Timing:
    """Where `simulate` put every action: start ticks, and the P x T grid (None = idle)."""

    start: dict[tuple[int, Action], int]
    grid: list[list[Action | None]]

    @property
    def ticks(self) -> int:
        return len(self.grid[0])

    def bubble_fraction(self) -> float:
        """Idle cells over all cells: the share of P*T rank-ticks nobody computes."""
        idle = sum(cell is None for row in self.grid for cell in row)
        return idle / (len(self.grid) * self.ticks)


def simulate(schedule: Schedule, forward_ticks: int = 1, backward_ticks: int = 1) -> Timing:
    """Place every action at its earliest tick: after its dependencies and after the previous
    action of its own rank. Raises ValueError when a rank's order contradicts the dependencies
    (the ranks would wait for each other forever: a deadlock in the schedule itself)."""
    num_stages = len(schedule)
    num_microbatches(schedule)
    duration = {"F": forward_ticks, "B": backward_ticks}
    start: dict[tuple[int, Action], int] = {}
    finish: dict[tuple[int, Action], int] = {}
    next_index, free_at = [0] * num_stages, [0] * num_stages
    progress = True
    while progress:
        progress = False
        for s in range(num_stages):
            while next_index[s] < len(schedule[s]):
                action = schedule[s][next_index[s]]
                deps = dependencies(s, action, num_stages)
                if any(d not in finish for d in deps):
                    break  # wait for another rank; come back on the next sweep
                t = max([free_at[s], *(finish[d] for d in deps)])
                start[(s, action)], finish[(s, action)] = t, t + duration[action.kind]
                free_at[s] = finish[(s, action)]
                next_index[s] += 1
                progress = True
    stuck = [f"rank {s} at {schedule[s][i]}" for s, i in enumerate(next_index) if i < len(schedule[s])]
    if stuck:
        raise ValueError("the schedule deadlocks: " + ", ".join(stuck) + " wait forever")
    ticks = max(free_at)
    grid: list[list[Action | None]] = [[None] * ticks for _ in range(num_stages)]
    for (s, action), t in start.items():
        for k in range(duration[action.kind]):
            grid[s][t + k] = action
    return Timing(start, grid)


def bubble_fraction(schedule: Schedule, forward_ticks: int = 1, backward_ticks: int = 1) -> float:
    return simulate(schedule, forward_ticks, backward_ticks).bubble_fraction()


def peak_in_flight(schedule: Schedule) -> list[int]:
    """Per rank: the most micro-batches forwarded but not yet backwarded at any point of its
    order, i.e. how many micro-batches' activations the stage must hold at once."""
    peaks = []
    for order in schedule:
        held = peak = 0
        for action in order:
            held += 1 if action.kind == "F" else -1
            peak = max(peak, held)
        peaks.append(peak)
    return peaks


def render(timing: Timing, title: str = "") -> Table:
    """The grid as a rich table: one row per rank, one column per tick, '.' where a rank idles."""
    table = Table(title=title or None, title_justify="left", show_edge=False, pad_edge=False,
                  padding=(0, 1), box=None)
    table.add_column("", justify="right", style="bold")
    for t in range(timing.ticks):
        table.add_column(str(t), justify="center", style="dim" if t % 5 else None)
    styles = {"F": "cyan", "B": "magenta"}
    for s, row in enumerate(timing.grid):
        cells = [f"[{styles[a.kind]}]{a}[/]" if a else "[dim].[/]" for a in row]
        table.add_row(f"rank {s}", *cells)
    return table
