"""Who computes when: per-rank spans of work, gathered to rank 0, checked and drawn.

Each rank records (label, start, end) around its compute with `time.perf_counter()`, which on Linux
reads CLOCK_MONOTONIC, one clock for every process on the machine, so spans from different ranks on
one node line up. (Across nodes the clocks differ; the spans of each rank stay meaningful.)

On a GPU the host's clock alone would time the launches, not the work: a CUDA op returns as soon as its
kernel is queued, and the GPU runs it later, while the host has moved on (to the next span, or to a
`send` that waits). So a timeline on a CUDA device synchronizes it at both ends of every span: the span
starts when the work queued before it is done and ends when its own is. That costs a little overlap the
host could have had, which is what a timeline that shows who computes when must give up.

From the gathered spans: the largest number of ranks computing at the same instant (1 for naive
model parallelism: the point of lesson 01), each rank's busy fraction of the step, the idle share
(the measured bubble), and the step's duration.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from rich.text import Text

from distlab.processes.console import console


@dataclass(frozen=True)
class Span:
    rank: int
    label: str
    start: float
    end: float
    step: int = 0


def synchronized_now(device: torch.device | None) -> float:
    """The host's clock once `device` has done everything queued on it (CUDA: synchronized first)."""
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def timed(fn: Callable[[], object], device: torch.device | None) -> float:
    """Seconds `fn()` takes to run on `device`: its work, not its launches (see above)."""
    start = synchronized_now(device)
    fn()
    return synchronized_now(device) - start


class Timeline:
    """Spans of work on one rank."""

    def __init__(self, rank: int, device: torch.device | None = None):
        self.rank, self.device = rank, device
        self.spans: list[Span] = []

    @contextmanager
    def span(self, label: str, step: int = 0) -> Iterator[None]:
        start = synchronized_now(self.device)
        try:
            yield
        finally:
            self.spans.append(Span(self.rank, label, start, synchronized_now(self.device), step))

    def gather(self) -> list[Span]:
        """Every rank's spans, on every rank, sorted by start time (a collective: call on all ranks)."""
        per_rank: list[list[Span]] = [[] for _ in range(dist.get_world_size())]
        dist.all_gather_object(per_rank, self.spans)
        return sorted((s for spans in per_rank for s in spans), key=lambda s: s.start)


def max_concurrency(spans: list[Span]) -> int:
    """The most spans open at one instant (a sweep over start/end events; an end at the same
    instant as a start closes first, so back-to-back spans do not count as overlapping)."""
    events = sorted([(s.start, 1) for s in spans] + [(s.end, -1) for s in spans], key=lambda e: (e[0], e[1]))
    open_now = peak = 0
    for _, delta in events:
        open_now += delta
        peak = max(peak, open_now)
    return peak


def busy_fractions(spans: list[Span], world_size: int) -> list[float]:
    """Per rank: time inside spans / the whole window from the first start to the last end."""
    t0, t1 = min(s.start for s in spans), max(s.end for s in spans)
    busy = [0.0] * world_size
    for s in spans:
        busy[s.rank] += s.end - s.start
    return [b / (t1 - t0) for b in busy]


def idle_fraction(spans: list[Span], world_size: int) -> float:
    """The measured bubble: the share of P x the window in which no rank computes, 1 - mean busy."""
    return 1 - sum(busy_fractions(spans, world_size)) / world_size


def render(spans: list[Span], world_size: int, width: int | None = None, labels: list[str] | None = None) -> Text:
    """A text Gantt chart: one row per rank, one column per time bucket, the span's kind where the
    rank is busy ('F' forward, 'I' backward, 'W' weight gradient) and '.' where it idles. `width`
    buckets; by default as many as fit the output beside the row labels (at most 100). `labels` names the
    rows where they are not ranks (a step and its copy thread); by default "rank r"."""
    labels = labels or [f"rank {rank}" for rank in range(world_size)]
    pad = max(len(label) for label in labels) + 1
    width = width or max(20, min(100, console.width - pad))
    t0, t1 = min(s.start for s in spans), max(s.end for s in spans)
    scale = width / max(t1 - t0, 1e-12)
    rows = [["."] * width for _ in range(world_size)]
    for s in spans:
        a = min(width - 1, int((s.start - t0) * scale))
        b = max(a + 1, min(width, int(round((s.end - t0) * scale))))
        for i in range(a, b):
            rows[s.rank][i] = s.label[0]
    text = Text()
    colors = {"F": "cyan", "I": "magenta", "W": "green"}
    for label, row in zip(labels, rows):
        text.append(f"{label} ".rjust(pad))
        for ch in row:
            text.append(ch, style=colors.get(ch, "dim"))
        text.append("\n")
    text.append(" " * pad + f"{t1 - t0:.4f} s from left to right")
    return text


def step_seconds(spans: list[Span], steps: int) -> float:
    """Median over the steps after the first (which pays one-off costs) of the time from the first
    span's start to the last span's end: a step's wall time as the ranks' compute saw it."""
    per_step = [
        max(s.end for s in spans if s.step == k) - min(s.start for s in spans if s.step == k)
        for k in range(min(1, steps - 1), steps)
    ]
    return statistics.median(per_step)
