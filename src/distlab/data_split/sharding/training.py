"""What every strategy of lesson 07 is measured by: the one training loop, and what a rank holds and sends.

    zero_grad(); loss = mse(model(x_r), target_r); loss.backward(); after_backward();
    optimizer.step(); after_step()

is `distlab.proof.training.train` run for `cfg.steps` steps of the global batches of
`distlab.data_split.sharding.problem`,
everything from building the model on inside one `PeakMemory`: its peak is the step's peak (model
states, activations and transient buffers), and what it still holds at the end (`live_bytes`) is the
model states alone (the batches are made before it, the loss is dropped). `held` counts the same bytes
item by item, from the storages of the tensors the strategy keeps (`distlab.proof.held`); both are what the
formulas of `distlab.data_split.sharding.accounting` predict. `sent` is the bytes the strategy's ring sent per step.
The record's first gradients are read (gathered whole) with the measurement paused: they are the
check's, not the strategy's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch.utils._pytree import tree_map

from distlab.data_split.sharding.problem import ShardingConfig, build_model, global_batch, loss_fn, rows_of
from distlab.processes.identity import Runtime
from distlab.proof.held import storage_bytes
from distlab.proof.memory import PeakMemory
from distlab.proof.training import Run, mean_over_ranks, train


@dataclass
class StrategyRun(Run):
    """A `distlab.proof.training.Run` (whole tensors, gathered from the shards) and what the rank held and sent."""

    held: dict[str, int] = field(default_factory=dict)  # bytes of each item this rank holds after the last step
    live_bytes: int = 0  # PeakMemory: bytes still held after the last step
    peak_bytes: int = 0  # PeakMemory: the peak during the run
    sent: int = -1  # bytes this rank's ring sent per step (-1: not counted)


def local_rows(rt: Runtime, cfg: ShardingConfig, first: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's rows of the global batches of steps first .. first + steps - 1."""
    return [tuple(rows_of(t, rt) for t in global_batch(cfg, step)) for step in range(first, first + steps)]


def steps_of(strategy, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> Callable[[int], torch.Tensor]:
    """The loop's `step`: the mean loss of step k's rows, backward."""

    def step(k: int) -> torch.Tensor:
        x, target = batches[k]
        loss = loss_fn(strategy.model(x), target)
        loss.backward()
        return loss

    return step


@contextmanager
def paused(mem: PeakMemory) -> Iterator[None]:
    """Inside the block, `mem` counts nothing: what is made in it (a check's copies) is not the run's.
    What it had counted and is freed meanwhile is still taken off."""
    mem.__exit__(None, None, None)
    try:
        yield
    finally:
        mem.__enter__()


class _Measured:
    """A strategy as the loop sees it while `mem` measures it: its readouts (the check's gathers and
    copies) made with the measurement paused, and handed back on the CPU, where the loop keeps them: on a
    GPU the copy to the host is a new storage, which, made outside the pause, would count as the run's."""

    def __init__(self, strategy, mem: PeakMemory):
        self.strategy, self.mem, self.optimizer = strategy, mem, strategy.optimizer

    def zero_grad(self) -> None:
        self.strategy.zero_grad()

    def after_backward(self) -> None:
        self.strategy.after_backward()

    def after_step(self) -> None:
        self.strategy.after_step()

    def _read(self, readout: Callable) -> dict:
        """readout()'s tensors (a name -> tensor dict, or name -> dict of them) copied to the CPU, unmeasured."""
        with paused(self.mem):
            return tree_map(lambda t: t.cpu(), readout())

    def grads(self) -> dict[str, torch.Tensor]:
        return self._read(self.strategy.grads)

    def params(self) -> dict[str, torch.Tensor]:
        return self._read(self.strategy.params)

    def states(self) -> dict[str, dict[str, torch.Tensor]]:
        return self._read(self.strategy.states)


def run_strategy(rt: Runtime, cfg: ShardingConfig, make: Callable, steps: int | None = None) -> StrategyRun:
    """`make(model, rt, cfg)` -> a strategy (a trainee of `distlab.proof.training.train` with `model`, `items()`
    and a counting `ring` or None); trained and measured."""
    batches = local_rows(rt, cfg, 0, cfg.steps if steps is None else steps)
    with PeakMemory() as mem:
        strategy = make(build_model(cfg).to(rt.device), rt, cfg)
        run = train(_Measured(strategy, mem), steps_of(strategy, batches), len(batches), keep_states=True)
        live, peak = mem.live_bytes, mem.peak_bytes
    held = {item: storage_bytes(tensors) for item, tensors in strategy.items().items()}
    ring = getattr(strategy, "ring", None)
    sent = ring.ledger.sent // len(batches) if ring is not None else -1
    losses = mean_over_ranks(run.losses, rt)  # equal shares: the global loss is the mean of the ranks' means
    return StrategyRun(
        run.first_grads, run.params, losses, run.states, held=held, live_bytes=live, peak_bytes=peak, sent=sent
    )
