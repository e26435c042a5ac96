"""The loop every strategy of lesson 07 runs, and what it measures on each rank.

    zero_grad(); loss = mse(model(x_r), target_r); loss.backward(); after_backward();
    optimizer.step(); after_step()

for `cfg.steps` steps of the global batches of `distlab.sharding.problem`, everything from building
the model on inside one `PeakMemory`: its peak is the step's peak (model states, activations and
transient buffers), and what it still holds at the end (`live_bytes`) is the model states alone
(the batches are made before it, the loss is dropped). `held` counts the same bytes item by item,
from the storages of the tensors the strategy keeps; both are what the formulas of
`distlab.sharding.accounting` predict. `sent` is the bytes the strategy's ring sent per step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from distlab.memory import PeakMemory
from distlab.runtime import Runtime
from distlab.sharding.problem import ShardingConfig, Trained, build_model, global_batch, loss_fn, rows_of


@dataclass
class StrategyRun:
    trained: Trained
    held: dict[str, int]  # bytes of each item this rank holds after the last step
    live_bytes: int  # PeakMemory: bytes still held after the last step
    peak_bytes: int  # PeakMemory: the peak during the run
    sent: int  # bytes this rank's ring sent per step (-1: not counted)


def storage_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages under `tensors` (views of one storage count once)."""
    seen = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def local_rows(rt: Runtime, cfg: ShardingConfig, first: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's rows of the global batches of steps first .. first + steps - 1."""
    return [tuple(rows_of(t, rt) for t in global_batch(cfg, step)) for step in range(first, first + steps)]


def run_strategy(rt: Runtime, cfg: ShardingConfig, make: Callable, steps: int | None = None) -> StrategyRun:
    """`make(model, rt, cfg)` -> a strategy (model, optimizer, zero_grad, after_backward,
    after_step, items, full_params, full_states, and a `ring` or None); trained and measured."""
    batches = local_rows(rt, cfg, 0, cfg.steps if steps is None else steps)
    losses = []
    with PeakMemory() as mem:
        strategy = make(build_model(cfg).to(rt.device), rt, cfg)
        for x, target in batches:
            strategy.zero_grad()
            loss = loss_fn(strategy.model(x), target)
            loss.backward()
            strategy.after_backward()
            strategy.optimizer.step()
            strategy.after_step()
            losses.append(loss.item())
            del loss
        live, peak = mem.live_bytes, mem.peak_bytes
    held = {item: storage_bytes(tensors) for item, tensors in strategy.items().items()}
    ring = getattr(strategy, "ring", None)
    sent = ring.ledger.sent // len(batches) if ring is not None else -1
    mean = torch.tensor(losses, dtype=torch.float64, device=rt.device)
    dist.all_reduce(mean)  # equal shares: the global loss is the mean of the ranks' means
    trained = Trained(
        strategy.full_params(), strategy.full_grads(), strategy.full_states(), (mean / rt.world_size).tolist()
    )
    return StrategyRun(trained, held, live, peak, sent)
