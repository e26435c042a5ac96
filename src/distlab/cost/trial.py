"""A split of lesson 13's transformer stack built and run on this rank: the measured side of "what a step
costs". `Trial` builds the stack for one `Parallel` (whole blocks under lesson 07's DDP by hand, or lesson 08's
tensor-parallel blocks, with or without sequence parallelism and recomputation), counts one step's FLOPs
(`FlopCounterMode`, attention on its math backend so the counter sees its products) and its aten ops, and reads
what the rank holds, keeps and sends (`Measured`); `timed` times the trials in turns. The prediction these are held
against is the lesson's own (`lessons/13_cost.py`: `rank_bytes`, `predicted`) and `distlab.cost`'s."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode

from distlab.comm.ledger import Ledger
from distlab.comm.timing import barrier, slowest_median
from distlab.cost import calibrate
from distlab.cost.inputs import Batch, Parallel
from distlab.data_split.sharding.problem import ShardingConfig, optimizer_of, rows_of
from distlab.data_split.sharding.replicated import Replicated
from distlab.layer_split.tensor_parallel import operators
from distlab.layer_split.tensor_parallel.blocks import ParallelBlock
from distlab.layer_split.tensor_parallel.sequence import reduce_sequence_parallel_grads, seq_part
from distlab.processes.identity import Runtime
from distlab.proof.held import SavedActivations, model_states, storage_bytes
from distlab.proof.models import Block, BlockOptions, token_batch
from distlab.proof.sizes import Transformer
from distlab.proof.training import Plain


@dataclass
class Measured:
    held: dict[str, int]  # bytes of each model-state item after a step, by storage
    activations: int  # what the forward keeps for backward, plus the output
    sent: Counter  # bytes sent in a step, per collective (every phase)
    flops: int  # FlopCounterMode's count of one step
    seconds: float  # one step, the slowest rank's, median over the repeats
    ops: int  # aten ops one step dispatches


@dataclass(frozen=True)
class Stack:
    """What a trial trains: `model.layers` blocks of its sizes (no embedding), on `batch`'s N x seq rows, with
    AdamW at rate `lr`; block i seeded `seed + i`, the data `seed + 100`."""

    model: Transformer
    batch: Batch
    lr: float = 1e-3
    seed: int = 0


def build(rt: Runtime, stack: Stack, parallel: Parallel, options: BlockOptions):
    """The stack on this rank (whole blocks, or their tensor-parallel parts), its trainee, its data, and
    the ledger its collectives count their bytes in."""
    m, batch, seed = stack.model, stack.batch, stack.seed
    blocks = [
        Block(m.dim, m.heads, m.ffn, options, seed=seed + i, dtype=torch.float32).to(rt.device) for i in range(m.layers)
    ]
    x, target = (t.to(rt.device) for t in token_batch(batch.global_batch, batch.seq, m.dim, seed + 100, torch.float32))
    optimizer = ShardingConfig(lr=stack.lr)  # AdamW, weight decay 0.1
    if parallel.tp == 1:  # data parallel: C = N / P rows, one ring all-reduce per block (lesson 07's DDP)
        model = nn.Sequential(*blocks)
        trainee = Replicated(model, rt, optimizer)
        return model, trainee, rows_of(x, rt), rows_of(target, rt), trainee.ring.ledger
    comm = (operators.sequence_parallel if parallel.sp else operators.tensor_parallel)(None, Ledger())
    model = nn.Sequential(*[ParallelBlock(b, rt.rank, rt.world_size, comm) for b in blocks])
    trainee = Plain(
        model, optimizer_of(model.parameters(), optimizer), lambda: reduce_sequence_parallel_grads(model, comm)
    )
    if parallel.sp:
        x, target = (seq_part(t, rt.rank, rt.world_size) for t in (x, target))
    return model, trainee, x, target, comm.ledger


def forward(model: nn.Sequential, x: torch.Tensor, recompute: bool) -> torch.Tensor:
    for block in model:
        x = checkpoint(block, x, use_reentrant=False) if recompute else block(x)
    return x


class Trial:
    """One configuration on this rank, built and run: one step under the FLOP counter (attention on its
    math backend, so that the counter sees its products), one with its ops counted; then timed steps."""

    def __init__(self, rt: Runtime, stack: Stack, parallel: Parallel, options: BlockOptions):
        self.parallel, self.steps = parallel, 0
        self.model, self.trainee, self.x, self.target, self.ledger = build(rt, stack, parallel, options)
        with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
            self.step()
        with calibrate.CountOps() as count:
            self.step()
        self.flops, self.ops = counter.get_total_flops(), count.ops

    def step(self) -> None:
        self.trainee.zero_grad()
        ((forward(self.model, self.x, self.parallel.recompute) - self.target) ** 2).mean().backward()
        self.trainee.after_backward()
        self.trainee.optimizer.step()
        self.steps += 1

    def measured(self, seconds: float) -> Measured:
        """What the rank holds after its steps, sends per step, and keeps in one more forward."""
        sent = Counter()
        for (_, kind), nbytes in self.ledger.sent_by.items():  # the ring by hand counts messages: DDP's all-reduces
            sent["all_reduce" if kind == "send" else kind] += nbytes // self.steps
        params = list(self.model.parameters())
        states = model_states(params, [q.grad for q in params], [self.trainee.optimizer.state[q] for q in params])
        with SavedActivations(exclude=[self.x, *params]) as saved:
            out = forward(self.model, self.x, self.parallel.recompute)
        held = {item: storage_bytes(tensors) for item, tensors in states.items()}
        return Measured(held, saved.nbytes + out.untyped_storage().nbytes(), sent, self.flops, seconds, self.ops)


def timed(rt: Runtime, trials: dict[str, Trial], repeats: int) -> dict[str, float]:
    """Each trial's step, the slowest rank's, median over `repeats`: the trials take turns, so a load that
    drifts (P ranks and other jobs share this machine's cores) hits them all alike."""
    seconds = {name: [] for name in trials}
    for _ in range(repeats):
        for name, trial in trials.items():
            barrier(rt)
            start = time.perf_counter()
            trial.step()
            if rt.device.type == "cuda":
                torch.cuda.synchronize(rt.device)  # the step has run, not only been queued
            seconds[name].append(time.perf_counter() - start)
    return {name: slowest_median(rt, s) for name, s in seconds.items()}
