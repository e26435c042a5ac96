"""An emulated device: compute and messages that cost a fixed wall time without occupying a core.

Why. On a CPU with fewer cores than ranks the ranks take turns on the cores, so a measured timeline
shows the operating system's scheduling, not the schedule's: two "busy" ranks cannot both compute,
and an all-reduce from a hook competes with the backward it is meant to hide behind. An accelerator
per rank does not have that problem. Here each rank gets one, emulated: a layer's forward, input
gradient and weight gradient each cost `ms_per_layer` of wall time in which the rank SLEEPS (a sleep
holds no core), and a message on the emulated link costs `ms_per_mib` per MiB on a thread of its
own. The real math still runs inside that time, so every gradient stays exact; only the clock is
emulated. A run in this mode is labelled "emulated device" wherever it is printed.

    an action of a pipeline stage with `layers` layers costs  units x layers x ms_per_layer,
    units: F 1, a split I 1, W 1, an unsplit I 2 (input and weight gradient together)

That is the simulator's unit grid (t_F = t_I = t_W = 1) made real: with free messages a measured
step should approach the grid's length and its bubble. `pad` does it for a whole action (run the
math, then sleep what is left of the action's time); `slow_layers` does it per layer with module
hooks, for a plain backward whose gradients must arrive layer by layer (data parallelism);
`EmulatedLink` is the wire for the data-parallel buckets.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from distlab.proof.memory import MIB


@dataclass(frozen=True)
class EmulatedDevice:
    """The emulated device's cost model; `ms_per_layer` 0 means the real CPU (no padding)."""

    ms_per_layer: float = 0.0

    @property
    def on(self) -> bool:
        return self.ms_per_layer > 0

    @contextmanager
    def pad(self, units: float) -> Iterator[None]:
        """Run the body, then sleep until `units` x ms_per_layer have passed since it started."""
        start = time.perf_counter()
        yield
        left = start + units * self.ms_per_layer / 1e3 - time.perf_counter()
        if self.on and left > 0:
            time.sleep(left)


def action_units(kind: str, split: bool, layers: int) -> int:
    """A pipeline action's cost in layer-passes: F, split I and W one per layer, unsplit I two."""
    return layers * (2 if kind == "I" and not split else 1)


def slow_layers(model: nn.Sequential, device: EmulatedDevice) -> list:
    """Make each layer of `model` cost ms_per_layer in forward and twice that in backward (input
    and weight gradient), as sleeps inside autograd: the gradients of the last layer are ready
    first, then the next, as on a device. Returns the hook handles (`.remove()` them to undo)."""
    seconds = device.ms_per_layer / 1e3

    def forward(layer, inputs, output):
        time.sleep(seconds)
        if output.requires_grad:  # runs when the output's gradient arrives, before the layer's backward
            output.register_hook(lambda grad: time.sleep(2 * seconds))

    return [layer.register_forward_hook(forward) for layer in model]


class _Sent:
    """What `EmulatedLink.all_reduce` returns: a `dist.Work`-like handle (`wait()`, `get_future()`)."""

    def __init__(self):
        self.future: torch.futures.Future = torch.futures.Future()
        self.settled = threading.Event()  # set once the future's callbacks have run too

    def wait(self) -> bool:
        self.settled.wait()
        self.future.wait()  # raises what the link raised
        return True

    def get_future(self) -> torch.futures.Future:
        return self.future


class EmulatedLink:
    """The emulated wire of one rank: one message at a time, in the order they were sent, each
    taking `ms_per_mib` per MiB (the real all-reduce runs inside that time, then the link sleeps
    the rest), on the link's own thread, so the rank's backward goes on meanwhile. Every rank sends
    the same messages in the same order, so the collectives match."""

    def __init__(self, ms_per_mib: float):
        self.ms_per_mib = ms_per_mib
        self.thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="emulated-link")

    def all_reduce(self, tensor: torch.Tensor) -> _Sent:
        sent = _Sent()
        cost = EmulatedDevice(self.ms_per_mib * tensor.numel() * tensor.element_size() / MIB)

        def send() -> None:
            try:
                with cost.pad(1):
                    dist.all_reduce(tensor)
                sent.future.set_result(tensor)
            except Exception as err:  # noqa: BLE001 -- handed to whoever waits, never lost in the thread
                sent.future.set_exception(err)
            finally:
                sent.settled.set()

        self.thread.submit(send)
        return sent

    def close(self) -> None:
        self.thread.shutdown(wait=True)
