"""Timing gradient synchronisation: a step with all-reduces after backward against one that overlaps them.

A strategy is a function `model -> (module to call, sync to run after backward)`. `time_strategies`
builds one fresh model per strategy and times forward + backward + sync, round-robin over the
strategies (so a noisy neighbour slows all of them alike), each repetition timed on the slowest rank,
the median reported. `backward_timeline` records one step: when backward started and ended, and
when each bucket's all-reduce was launched and completed, in milliseconds from the start of backward.
`emulated_overlap` does both on the emulated device (`distlab/proof/emulate.py`), where the all-reduces do
not compete with backward for the cores: the buckets after backward against from the hooks, and the
share of the communication the hooks hid against 1 - (last bucket's bytes) / (all bytes).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from distlab.comm.timing import barrier, slowest_median
from distlab.data_split.data_parallel.problem import DataParallelConfig, build, mean_loss, shard
from distlab.data_split.data_parallel.report import timeline_table, timing_table
from distlab.processes.console import print0
from distlab.processes.identity import Runtime
from distlab.proof import emulate

Strategy = Callable[[nn.Module], tuple[nn.Module, Callable[[], None]]]


def no_communication(model: nn.Module) -> tuple[nn.Module, Callable[[], None]]:
    """The compute alone: what a step would cost if communication were free."""
    return model, lambda: None


@dataclass(frozen=True)
class StepSeconds:
    step_s: float  # forward + backward + sync
    backward_s: float  # loss.backward() alone (with whatever the strategy's hooks do inside it)


def _sync_device(rt: Runtime) -> None:
    if rt.device.type == "cuda":
        torch.cuda.synchronize(rt.device)


def _one_step(rt: Runtime, module: nn.Module, sync: Callable[[], None], batch: tuple) -> tuple[float, float]:
    module.zero_grad(set_to_none=True)
    barrier(rt)
    start = time.perf_counter()
    loss = mean_loss(module(batch[0]), batch[1])
    _sync_device(rt)
    backward_start = time.perf_counter()
    loss.backward()
    _sync_device(rt)
    backward_end = time.perf_counter()
    sync()
    _sync_device(rt)
    return time.perf_counter() - start, backward_end - backward_start


def time_strategies(
    rt: Runtime, cfg: DataParallelConfig, strategies: dict[str, Strategy], repeats: int
) -> dict[str, StepSeconds]:
    """Median seconds of one step, and of its backward, per strategy (slowest rank)."""
    _, x, target = build(cfg)
    batch = (shard(x, rt), shard(target, rt))
    prepared = {name: make(build(cfg)[0].to(rt.device)) for name, make in strategies.items()}
    steps: dict[str, list[float]] = {name: [] for name in strategies}
    backwards: dict[str, list[float]] = {name: [] for name in strategies}
    for repeat in range(repeats + 1):  # the first round warms up (allocations, first connections)
        for name, (module, sync) in prepared.items():
            step, backward = _one_step(rt, module, sync, batch)
            if repeat:
                steps[name].append(step)
                backwards[name].append(backward)
    return {
        name: StepSeconds(slowest_median(rt, steps[name]), slowest_median(rt, backwards[name])) for name in strategies
    }


@dataclass
class BucketTimeline:
    backward_end_ms: float  # loss.backward() returned (it started at 0)
    launched_ms: list[float]  # per bucket: when its all-reduce was launched
    done_ms: list[float]  # per bucket: when its all-reduce completed
    synced_ms: float  # sync() returned: every gradient averaged


def backward_timeline(
    rt: Runtime,
    cfg: DataParallelConfig,
    module: nn.Module,
    sync: Callable[[], None],
    events: dict[str, dict[int, float]],
) -> BucketTimeline:
    """One step, timed. `events` is where the sync mechanism stamps time.perf_counter() per bucket:
    events["launched"][i], events["done"][i]. Times in ms from the start of backward."""
    _, x, target = build(cfg)
    x, target = shard(x, rt), shard(target, rt)
    module.zero_grad(set_to_none=True)
    loss = mean_loss(module(x), target)
    events["launched"].clear()
    events["done"].clear()
    barrier(rt)
    start = time.perf_counter()
    loss.backward()
    end = time.perf_counter()
    sync()
    synced = time.perf_counter()
    ms = lambda t: (t - start) * 1e3  # noqa: E731
    order = sorted(events["launched"])
    return BucketTimeline(
        ms(end), [ms(events["launched"][i]) for i in order], [ms(events["done"][i]) for i in order], ms(synced)
    )


class Buckets(Protocol):
    """What lesson 06's gradient buckets offer: `wait` (every gradient averaged), the buckets' parameters, and
    the times each bucket's all-reduce was launched and done (`events["launched"][i]`, `events["done"][i]`)."""

    buckets: list[list[nn.Parameter]]
    events: dict[str, dict[int, float]]

    def wait(self) -> None: ...


def emulated_overlap(
    rt: Runtime,
    cfg: DataParallelConfig,
    device: emulate.EmulatedDevice,
    link: emulate.EmulatedLink,
    repeats: int,
    make_buckets: Callable[[nn.Module, bool], Buckets],
) -> dict:
    """Lesson 06's buckets (`make_buckets(model, overlap)`, all-reducing on `link`) on the emulated `device`:
    step times without communication, with the buckets after backward and from the hooks; one step's
    timeline; the hidden share of the communication, measured and predicted. Prints its tables."""
    # Four rows per rank: the same gradients' bytes (they depend on the layers, not the rows) at a
    # fraction of the real compute, which would otherwise still compete for the cores.
    cfg = dataclasses.replace(cfg, global_batch=4 * rt.world_size)

    def on_device(overlap: bool | None) -> Strategy:
        def make(model: nn.Module):
            emulate.slow_layers(model, device)
            return model, (lambda: None) if overlap is None else make_buckets(model, overlap).wait

        return make

    times = time_strategies(
        rt,
        cfg,
        {
            "compute only": on_device(None),
            "buckets, after backward": on_device(False),
            "buckets from hooks (overlap)": on_device(True),
        },
        max(2, repeats // 3),
    )
    print0(
        f"\n[bold]The same on the emulated device[/] ({device.ms_per_layer:g} ms per layer-pass, "
        f"{link.ms_per_mib:g} ms per MiB on the link, C = 4 rows per rank):"
    )
    print0(timing_table(times, baseline="compute only"))
    model = build(cfg)[0].to(rt.device)
    on_device(True)(model)
    buckets = make_buckets(model, True)
    for _ in range(2):  # the second step: the first pays for warming up
        line = backward_timeline(rt, cfg, model, buckets.wait, buckets.events)
    sizes = [sum(p.numel() * p.element_size() for p in b) for b in buckets.buckets]
    print0(timeline_table(line.launched_ms, line.done_ms, sizes, line.backward_end_ms))
    comm = times["buckets, after backward"].step_s - times["compute only"].step_s
    hidden = (times["buckets, after backward"].step_s - times["buckets from hooks (overlap)"].step_s) / comm
    predicted = 1 - sizes[-1] / sum(sizes)
    print0(
        f"emulated device: the hooks hid {hidden:.0%} of the communication's {comm * 1e3:.0f} ms; "
        f"if the link keeps up with backward, 1 - last bucket's bytes / all bytes = {predicted:.0%} (where a "
        f"bucket took longer than its {link.ms_per_mib:g} ms per MiB above, the real all-reduce overran it)"
    )
    return {
        "step_seconds": {name: vars(t) for name, t in times.items()},
        "hidden": hidden,
        "predicted": predicted,
        "timeline": vars(line) | {"bucket_bytes": sizes},
    }
