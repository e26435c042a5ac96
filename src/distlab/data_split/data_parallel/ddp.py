"""DistributedDataParallel, measured: it averages; `no_sync`; `find_unused_parameters`; a global loss.

- `wrap`: DDP on the rank's device. DDP registers a hook per parameter, groups the gradients into
  buckets (about 25 MiB; the first one smaller), all-reduces each bucket as soon as backward has
  filled it, and divides by P: the mechanism lesson 06 writes by hand.
- `count_and_average`: a DDP communication hook that does what DDP's default does (average the
  bucket over the ranks) and counts the calls, one per bucket per synchronised backward, and the
  backwards that reduced (lesson 24: one per step under `no_sync` but the last); `counting` registers it.
- `accumulate`: gradient accumulation over micro-batches, with or without `no_sync()`. Without it
  every backward all-reduces; with it only the last one does. Both give the global gradient
  (averaging is linear), so `no_sync` saves communication, not correctness.
- `unused_branch`: a model with a branch that one step does not use. DDP waits for a gradient of
  every parameter before its last bucket is reduced; a parameter that got none leaves that bucket
  waiting. What torch 2.13 does then is run here, not assumed.
- `unused_outcome`: what `unused_branch` does with and without the flag, each step judged against one process
  (lesson 06 prints it and states the claim).
- `global_loss_gradients`: DDP on a loss every rank computes over the all-gathered batch.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distlab.data_split.data_parallel.problem import (
    DataParallelConfig,
    batch_lse_loss,
    build,
    gather_rows,
    mean_loss,
    shard,
)
from distlab.processes.identity import Runtime
from distlab.proof.compare import all_ok, compare, grads_of
from distlab.proof.models import _init_linear_


def wrap(model: nn.Module, rt: Runtime, find_unused_parameters: bool = False, bucket_mib: float = 25.0) -> DDP:
    """DDP on the rank's device (25 MiB is DDP's own default bucket size)."""
    model = model.to(rt.device)
    ids = [rt.device] if rt.device.type == "cuda" else None
    return DDP(model, device_ids=ids, find_unused_parameters=find_unused_parameters, bucket_cap_mb=bucket_mib)


@dataclass
class HookCalls:
    """What `count_and_average` saw: the buckets DDP handed to it (one all-reduce each), and the
    backwards that reduced (DDP may cut a backward's gradients into several buckets; the one marked
    last closes it: lesson 24 counts one per step under `no_sync` but the last)."""

    calls: int = 0
    backwards: int = 0
    group: object = None  # the process group DDP reduces over (None: the default group)


# Not annotated: DDP checks that `bucket` is annotated as dist.GradBucket itself, and this module's
# `from __future__ import annotations` would turn any annotation into a string.
def count_and_average(state, bucket):
    """DDP comm hook: average the bucket over the ranks, as DDP's default does, and count the call."""
    state.calls += 1
    state.backwards += bucket.is_last()
    tensor = bucket.buffer().div_(dist.get_world_size(state.group))
    return dist.all_reduce(tensor, group=state.group, async_op=True).get_future().then(lambda fut: fut.value()[0])


def counting(model: DDP, counter: HookCalls | None = None) -> HookCalls:
    """`count_and_average` registered on `model`, counting into `counter` (a new one by default; pass one
    to count several DDP modules together)."""
    counter = counter if counter is not None else HookCalls(group=model.process_group)
    model.register_comm_hook(counter, count_and_average)
    return counter


def accumulate(
    rt: Runtime, cfg: DataParallelConfig, micro_batches: int, no_sync: bool
) -> tuple[dict[str, torch.Tensor], int]:
    """One step's gradients, this rank's C rows in `micro_batches` parts, and the hook's call count."""
    model, x, target = build(cfg)
    ddp = wrap(model, rt)
    counter = counting(ddp)
    x, target = shard(x, rt), shard(target, rt)
    parts = list(zip(x.tensor_split(micro_batches), target.tensor_split(micro_batches)))
    for k, (xk, tk) in enumerate(parts):
        last = k == len(parts) - 1
        with ddp.no_sync() if no_sync and not last else nullcontext():
            # A micro-batch's mean, weighted by its share of the C rows: the parts sum to the mean
            # over all C rows, even when the parts are unequal.
            (mean_loss(ddp(xk), tk) * (len(xk) / len(x))).backward()
    return grads_of(model), counter.calls


class Branchy(nn.Module):
    """The MLP plus an auxiliary linear branch that a step may leave out."""

    def __init__(self, cfg: DataParallelConfig):
        super().__init__()
        self.trunk = build(cfg)[0]
        gen = torch.Generator().manual_seed(cfg.seed + 2)
        self.aux = _init_linear_(nn.Linear(cfg.widths[0], cfg.widths[-1], dtype=cfg.dtype), gen)

    def forward(self, x: torch.Tensor, use_aux: bool) -> torch.Tensor:
        out = self.trunk(x)
        return out + self.aux(x) if use_aux else out


USE_AUX = (True, False, True)  # the branch takes part in steps 1 and 3, not in step 2


@dataclass
class BranchyRun:
    grads: list[dict[str, torch.Tensor]] = field(default_factory=list)  # per completed step
    ranks_agree: list[bool] = field(default_factory=list)  # every rank holds the same gradients
    error: str | None = None  # what stopped the run, if anything
    warnings: list[str] = field(default_factory=list)  # what torch's C++ warned on this rank


UNUSED_SEARCH_WARNING = "did not find any unused parameters"  # torch 2.13's words, reducer.cpp


@contextmanager
def cpp_warnings() -> Iterator[list[str]]:
    """The lines torch's C++ writes to stderr inside the block (its TORCH_WARN goes to file descriptor
    2, not through Python's `warnings`), collected instead of printed: a lesson that provokes a warning
    on purpose says it once, in its own words. Lines that are not torch warnings are passed on."""
    sys.stderr.flush()
    saved = os.dup(2)
    lines: list[str] = []
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield lines
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            for line in sink.read().decode(errors="replace").splitlines():
                (lines.append(line) if "Warning:" in line else print(line, file=sys.stderr))


def _same_on_every_rank(grads: dict[str, torch.Tensor], rt: Runtime) -> bool:
    flat = torch.cat([g.reshape(-1) for g in grads.values()]).to(rt.device)
    high, low = flat.clone(), flat.clone()
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    return torch.equal(high, low)


def unused_branch(rt: Runtime, cfg: DataParallelConfig, find_unused_parameters: bool) -> BranchyRun:
    """SGD steps that use the branch as `USE_AUX` says, under DDP; stops at the first error."""
    model = Branchy(cfg)
    ddp = wrap(model, rt, find_unused_parameters)
    _, x, target = build(cfg)
    x, target = shard(x, rt), shard(target, rt)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=cfg.lr)
    run = BranchyRun()
    with cpp_warnings() as run.warnings:  # the flag's warning, once per rank: the lesson says it once
        for use_aux in USE_AUX:
            optimizer.zero_grad(set_to_none=True)
            try:
                mean_loss(ddp(x, use_aux), target).backward()
            except RuntimeError as err:  # raised on every rank alike: no collective is left waiting
                run.error = str(err).strip().splitlines()[0]
                break
            run.grads.append(grads_of(model))
            run.ranks_agree.append(_same_on_every_rank(run.grads[-1], rt))
            optimizer.step()
    return run


def branchy_reference(cfg: DataParallelConfig) -> list[dict[str, torch.Tensor]]:
    """The same steps in one process on the whole batch: each step's gradients."""
    model, (_, x, target) = Branchy(cfg), build(cfg)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    grads = []
    for use_aux in USE_AUX:
        optimizer.zero_grad(set_to_none=True)
        mean_loss(model(x, use_aux), target).backward()
        grads.append(grads_of(model))
        optimizer.step()
    return grads


def global_loss_gradients(rt: Runtime, cfg: DataParallelConfig, times_p: bool) -> tuple[float, dict[str, torch.Tensor]]:
    """DDP's gradient of the batch log-sum-exp loss that every rank computes over the gathered
    outputs; with `times_p` it back-propagates P * L (and reports L)."""
    model, x, _ = build(cfg)
    ddp = wrap(model, rt)
    loss = batch_lse_loss(gather_rows(ddp(shard(x, rt)), rt))
    (loss * rt.world_size if times_p else loss).backward()
    return loss.item(), grads_of(model)


@dataclass(frozen=True)
class UnusedOutcome:
    """`unused_branch` with and without `find_unused_parameters`, each step against one process: per flag the
    cells of a table row ("= one process", "ranks differ", "wrong", "RuntimeError") and the error that ended the
    run; whether torch warned, with the flag, that its search found nothing to do; and the row a correct DDP gives
    without the flag (step 2 un-averaged: its ranks differ, unless there is one rank)."""

    cells: dict[bool, list[str]]
    errors: dict[bool, str]
    warned: bool
    expected_without: list[str]


def unused_outcome(rt: Runtime, cfg: DataParallelConfig) -> UnusedOutcome:
    """Run `unused_branch` with and without the flag and judge every step against one process."""
    ref = branchy_reference(cfg)
    cells, errors, warned = {}, {}, False
    for flag in (False, True):
        run = unused_branch(rt, cfg, flag)
        row = [
            "= one process" if all_ok(compare(r, g)) else ("ranks differ" if not a else "wrong")
            for r, g, a in zip(ref, run.grads, run.ranks_agree)
        ]
        cells[flag], errors[flag] = row + ["RuntimeError"] * (len(USE_AUX) - len(row)), run.error
        warned = any(UNUSED_SEARCH_WARNING in line for line in run.warnings) if flag else warned
    expected = ["= one process", "= one process" if rt.world_size == 1 else "ranks differ", "RuntimeError"]
    return UnusedOutcome(cells, errors, warned, expected)
