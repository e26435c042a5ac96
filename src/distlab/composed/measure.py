"""One step of the mesh, measured: what each rank sent on each dimension of the mesh at each point of the
step, the activations it saved, and the model states it holds after the step.

The points of the step are the pipeline stage's own calls, which torch's schedule makes in its order:
`forward_one_chunk` (a micro-batch's forward, and the send of its activation that follows it),
`backward_one_chunk` (its backward, and the send of its input's gradient), `perform_reduce_grad` (after
the last backward: FSDP2's reduce-scatter of the gradients, the 1/M scaling), then the optimizer's step.
Each is wrapped for the step so that `distlab.comm.watch.CollectiveWatch` books what runs inside it under
that phase; the wrappers are removed after it. The first micro-batch's forward and its loss (the schedule's
`_maybe_compute_loss`) end with a mark for `SavedLive`. The optimizer's step communicates nothing: every
shard steps where it lies. The model states are read after the step (`held`).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from distlab.comm.watch import CollectiveWatch
from distlab.composed.activations import SavedLive
from distlab.proof.held import model_states, storage_bytes

SENDS_ONLY = {"pp": ("send",), "cp": ("send",)}  # at dp = 1 the dp x cp group is the cp group: FSDP2's are not
PHASES = {"forward_one_chunk": "forward", "backward_one_chunk": "backward", "perform_reduce_grad": "gradients"}


@dataclass
class StepMeasured:
    """Bytes sent by (dimension, phase, collective), nonzero ones; activation bytes of the first micro-batch
    and at the peak."""

    sent: dict[tuple[str, str, str], int]
    activations: tuple[int, int]


@contextmanager
def _phases(stage, schedule, watch: CollectiveWatch, saved: SavedLive):
    def wrap(obj, name: str, before, after=None):
        method = getattr(obj, name)

        @functools.wraps(method)
        def wrapped(*args, **kwargs):
            before()
            out = method(*args, **kwargs)
            if after:
                after()
            return out

        setattr(obj, name, wrapped)

    for name, phase in PHASES.items():
        wrap(stage, name, functools.partial(setattr, watch, "phase", phase))
    last = stage.is_last
    wrap(stage, "forward_one_chunk", lambda: None, None if last else saved.mark)
    wrap(schedule, "_maybe_compute_loss", lambda: None, saved.mark if last else None)
    try:
        yield
    finally:
        for name in (*PHASES, "_maybe_compute_loss"):
            for obj in (stage, schedule):
                obj.__dict__.pop(name, None)  # the class's own method again


def held(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of each model-state item this rank holds: its shards (DTensors' local tensors), by storage."""
    params = list(model.parameters())

    def local(t):
        return t.to_local() if isinstance(t, DTensor) else t

    states = [{k: local(v) for k, v in optimizer.state[p].items()} for p in params]
    grads = [None if p.grad is None else local(p.grad) for p in params]
    items = model_states([local(p) for p in params], grads, states)
    return {item: storage_bytes(tensors) for item, tensors in items.items()}


@contextmanager
def measuring(mesh_step, groups: dict) -> Iterator[StepMeasured]:
    """with measuring(mesh_step, groups) as measured: mesh_step.step(k); then `measured.sent` and
    `measured.activations` (a lesson 12 `MeshStep`: its stage and schedule; `groups` by dimension label)."""
    measured = StepMeasured({}, (0, 0))
    with CollectiveWatch(groups, kinds=SENDS_ONLY) as watch, SavedLive() as saved:
        with _phases(mesh_step.stage, mesh_step.schedule, watch, saved):
            yield measured
    measured.sent = {(dim, *key): n for dim, ledger in watch.ledgers.items() for key, n in ledger.sent_by.items() if n}
    measured.activations = (saved.first_bytes or 0, saved.peak_bytes)
