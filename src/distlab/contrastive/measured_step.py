"""What one training step costs, measured in one process: peak memory, rows forwarded, time.

- `peak_mib(model, step, *args)`: the peak and the largest tensor of the storage `step(model, *args)`
  allocated (`distlab.proof.memory.PeakMemory`), parameter gradients included, in MiB.
- `rows_forwarded(module, step, model, *args)`: how many rows went through `module`'s forward (a
  forward hook counts them): a recompute shows as twice the batch.
- `interleaved_seconds(model, steps, repeats)`: the median time of each step, the methods taking
  turns so that a drifting load on a shared machine hits all of them alike.
- `right_aligned(table)`: a rich table whose number columns line up by their digits.
"""

from __future__ import annotations

import statistics
import time

import torch
from rich.table import Table
from torch import nn

from distlab.processes.console import progress
from distlab.proof.memory import MIB, PeakMemory


def right_aligned(table: Table, first: int = 1) -> Table:
    """Numbers line up by their digits: columns from `first` on, right-justified."""
    for column in table.columns[first:]:
        column.justify = "right"
    return table


def peak_mib(model: nn.Module, step, *args) -> tuple[float, float]:
    """(peak, largest tensor) in MiB of one step's tensor storage, parameter gradients included."""
    model.zero_grad(set_to_none=True)
    with PeakMemory() as mem:
        step(model, *args)
    return mem.peak_bytes / MIB, mem.largest_bytes / MIB


def rows_forwarded(module: nn.Module, step, model: nn.Module, *args) -> int:
    """Rows that went through `module`'s forward in one `step(model, *args)`."""
    seen = []
    handle = module.register_forward_hook(lambda mod, inputs, out: seen.append(len(out)))
    step(model, *args)
    handle.remove()
    return sum(seen)


def interleaved_seconds(model: nn.Module, steps: dict, repeats: int) -> dict[str, float]:
    """Median seconds per step; the methods take turns, so a drifting load hits all of them alike.
    `steps` maps a name to (step, args); each runs as step(model, *args)."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in progress(range(repeats), repeats, "timing"):
        for name, (step, args) in steps.items():
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            step(model, *args)
            if args[0].is_cuda:
                torch.cuda.synchronize(args[0].device)  # kernels run asynchronously
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}
