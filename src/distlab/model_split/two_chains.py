"""Two opposite chains of pipeline stages, for DualPipe in both directions (lesson 19): their naming, a
simulator for units (one action, or a forward and a backward run as a pair) under any costs, and the runner.

Naming. Two copies of the model, each cut in P chunks. Stage d P + k is position k of chain d: chain 0 runs
copy 0 with position k on rank k (rows enter at rank 0), chain 1 runs copy 1 with position k on rank
P - 1 - k (rows enter at rank P - 1). Micro-batch i belongs to chain i // (M/2).

The simulator places units as `simulator.simulate` places actions (in each rank's order, each at its
earliest time), with a choice the single-chain grid does not have: a pair is either its forward then its
backward, each half's result ready when that half ends (the runner's way), or ONE unit of time F&B whose
two results are ready only at its end (DeepSeek-V3's accounting: the halves interleave, each hiding the
other's messages). Its dependencies come from the caller (`simulator.dependencies` for one chain,
`two_chain_dependencies` for two).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F

from distlab.model_split.partition import boundary_shapes, split_stages
from distlab.model_split.schedules import Action
from distlab.model_split.simulator import Timing, dependencies
from distlab.model_split.training import PipelineConfig, problem
from distlab.proof.timeline import Timeline

Ticks = list[list[tuple[Action, ...]]]  # ticks[r] = rank r's units in order: one action, or a pair (F, B)
UNIT = {"F": 1, "I": 1, "B": 2, "W": 1, "FB": 3}  # ticks of one stage: a pair costs its two halves here


def flatten(ticks: Ticks) -> list[list[Action]]:
    return [[action for unit in order for action in unit] for order in ticks]


def direction_of(stage: int, num_ranks: int) -> tuple[int, int]:
    """A DualPipe stage's (direction, position): stage d P + k is position k of chain d (0 down, 1 up)."""
    return divmod(stage, num_ranks)


def chain_rank(stage: int, num_ranks: int) -> int:
    """Chain 0's position k runs on rank k, chain 1's on rank P - 1 - k (it enters at the last rank)."""
    d, k = direction_of(stage, num_ranks)
    return k if d == 0 else num_ranks - 1 - k


def two_chain_dependencies(action: Action, num_ranks: int) -> list[Action]:
    """The simulator's three dependencies (F after the previous stage's F; I after its own F and the
    next stage's I; W after I), inside the action's own chain: the two chains share no data."""
    d, k = direction_of(action.stage, num_ranks)
    inner = dependencies(Action(action.kind, action.microbatch, k), num_ranks)
    return [Action(x.kind, x.microbatch, d * num_ranks + x.stage) for x in inner]


def simulate_units(
    ticks: Ticks, deps, cost: dict[str, float], together: bool = False
) -> tuple[float, list[float], dict[Action, float]]:
    """Place every unit at its earliest time, one unit at a time per rank in the rank's order; returns
    (the step's time, each rank's idle time, each action's finish). `cost`: F, I (split), B (unsplit I),
    W, and FB, the time of a pair. `together` = False: a pair runs as its forward then its backward,
    each result ready when its half ends (the runner's way, and DualPipeV's grid); True: DeepSeek's F&B,
    one unit whose two results are ready only when the whole unit ends (its halves interleave, each
    hiding the other's messages)."""
    split = {(a.stage, a.microbatch) for order in ticks for unit in order for a in unit if a.kind == "W"}

    def took(a: Action) -> float:
        if a.kind == "I":
            return cost["I"] if (a.stage, a.microbatch) in split else cost["B"]  # split, or a full backward
        return cost[a.kind]

    finish: dict[Action, float] = {}
    nxt, free = [0] * len(ticks), [0.0] * len(ticks)
    progress = True
    while progress:
        progress = False
        for r, order in enumerate(ticks):
            while nxt[r] < len(order):
                unit = order[nxt[r]]
                needs = [d for a in unit for d in deps(a) if d not in unit]
                if any(d not in finish for d in needs):
                    break  # wait for another rank; come back on the next sweep
                end = free[r]
                if together and len(unit) == 2:  # one unit: it starts when both halves can
                    end = max([end, *(finish[d] for d in needs)]) + cost["FB"]
                    finish.update({a: end for a in unit})
                else:  # each action (each half of a pair) as soon as its own inputs are in
                    for a in unit:
                        end = max([end, *(finish[d] for d in deps(a))]) + took(a)
                        finish[a] = end
                free[r], nxt[r] = end, nxt[r] + 1
                progress = True
    if any(n < len(order) for n, order in zip(nxt, ticks)):
        raise ValueError("the order deadlocks")
    work = [sum(cost["FB"] if together and len(u) == 2 else sum(took(a) for a in u) for u in order) for order in ticks]
    step = max(free)
    return step, [step - w for w in work], finish


def unit_timing(ticks: Ticks, deps) -> Timing:
    """The grid on the unit costs (`UNIT`), each pair run as forward then backward (the runner's way)."""
    step, _, finish = simulate_units(ticks, deps, UNIT)
    split = {(a.stage, a.microbatch) for a in finish if a.kind == "W"}
    took = {a: 2 if a.kind == "I" and (a.stage, a.microbatch) not in split else 1 for a in finish}
    end = {a: int(f) for a, f in finish.items()}
    start = {a: end[a] - took[a] for a in end}
    grid: list[list[Action | None]] = [[None] * int(step) for _ in ticks]
    for r, order in enumerate(flatten(ticks)):
        for a in order:
            grid[r][start[a] : end[a]] = [a] * took[a]
    return Timing(start, end, grid)


class TwoChainStep:
    """The runner for two opposite chains (a `training.Step`) executing `ticks` (lesson 19's `dualpipe`):
    `runner.PipelineStep` follows one chain of stages, DualPipe has two. Rank r holds chunk r
    of copy 0 (chain 0: rows enter at rank 0) and chunk P - 1 - r of copy 1 (chain 1: rows enter at rank
    P - 1), both built from the same seed. Messages: a sender posts each one as it computes it (never
    waiting); a receiver takes a peer's messages in the order the peer sends them, up to the one it needs,
    so no order of receives can hang a schedule the simulator finds free of deadlock, and no tag is needed.
    After the last unit, the mirrors meet: ranks r and P - 1 - r hold the same two chunks, each in the
    other copy, so ONE exchange of their gradients (both chunks in chunk order) and a sum gives both copies
    the whole batch's gradient: a + b on one side and b + a on the other, equal bit for bit, so the copies
    step identically and stay equal. `sum_mirrors=False` is the wrong twin: each copy keeps half a batch."""

    def __init__(self, rt, cfg: PipelineConfig, ticks: Ticks, sum_mirrors: bool = True):
        P, M = rt.world_size, cfg.micro_batches
        model, x, target = problem(cfg)
        chunks = [split_stages(copy.deepcopy(model), P) for _ in range(2)]  # copy d's P chunks
        self.P, self.rank, self.cfg, self.device, self.sum_mirrors = P, rt.rank, cfg, rt.device, sum_mirrors
        self.mine = {d * P + k: chunks[d][k] for d in (0, 1) for k in range(P) if chain_rank(d * P + k, P) == rt.rank}
        self.stages = list(self.mine.values())  # what `train` steps: chunk r of copy 0, chunk P - 1 - r of copy 1
        self.mirror = P - 1 - rt.rank
        self.actions = [a for unit in ticks[rt.rank] for a in unit]
        self.split = {(a.stage, a.microbatch) for a in self.actions if a.kind == "W"}
        self.x = [part.clone() for part in torch.tensor_split(x, M)]
        self.target = [part.clone() for part in torch.tensor_split(target, M)]
        self.shapes = [boundary_shapes(chunks[0], tuple(part.shape), cfg.dtype) for part in self.x]
        for stage in self.mine.values():
            stage.module.to(rt.device)
        # What each peer sends this rank, in the peer's own order: (what, consuming stage, micro-batch).
        self.incoming = {
            peer: [m for a in flatten(ticks)[peer] if (m := self._message(a)) and chain_rank(m[1], P) == rt.rank]
            for peer in range(P)
        }
        self.timeline, self.peak = Timeline(rt.rank, rt.device), 0

    def _message(self, a: Action) -> tuple[str, int, int] | None:
        """What `a` hands on: F its output to the next position of its chain, I its input's gradient back."""
        _, k = direction_of(a.stage, self.P)
        if a.kind == "F" and k < self.P - 1:
            return "activation", a.stage + 1, a.microbatch
        if a.kind == "I" and k > 0:
            return "gradient", a.stage - 1, a.microbatch
        return None

    def __call__(self, step: int) -> float | None:
        self.held: dict = {}
        self.inbox: dict = {}
        self.sent: list = []
        self.taken = dict.fromkeys(range(self.P), 0)
        self.loss = torch.zeros((), dtype=torch.float64)
        run = {"F": self._forward, "I": self._backward, "W": self._weight}
        for a in self.actions:
            with self.timeline.span(str(a), step):
                run[a.kind](a)
        for work in self.sent:
            work.wait()
        if self.sum_mirrors:
            self._sum_mirrors()
        last = {self.P - 1, 2 * self.P - 1} & set(self.mine)  # chain 0's last chunk on rank P - 1, chain 1's on 0
        return self.loss.item() if last else None

    def measurements(self) -> dict:
        return dict(peak_in_flight=self.peak)

    def _take(self, message: tuple[str, int, int]) -> torch.Tensor:
        """Receive from the message's sender, in its order, until `message` is in."""
        what, stage, _ = message
        peer = chain_rank(stage + (1 if what == "gradient" else -1), self.P)  # the producing stage's rank
        while message not in self.inbox:
            got = self.incoming[peer][self.taken[peer]]
            self.taken[peer] += 1
            _, k = direction_of(got[1], self.P)  # an activation enters position k; a gradient leaves it: k + 1
            shape = self.shapes[got[2]][k + (got[0] == "gradient")]
            buffer = torch.empty(shape, dtype=self.cfg.dtype, device=self.device)
            dist.recv(buffer, peer)
            self.inbox[got] = buffer.requires_grad_(got[0] == "activation")
        return self.inbox.pop(message)

    def _send(self, message: tuple[str, int, int], tensor: torch.Tensor) -> None:
        self.sent.append(dist.isend(tensor.detach().contiguous(), chain_rank(message[1], self.P)))

    def _forward(self, a: Action) -> None:
        _, k = direction_of(a.stage, self.P)
        x = self.x[a.microbatch].to(self.device) if k == 0 else self._take(("activation", a.stage, a.microbatch))
        out = self.mine[a.stage].module(x)
        if k == self.P - 1:  # the chain's last chunk: the loss, scaled n_i / N (the whole batch's mean)
            out = F.mse_loss(out, self.target[a.microbatch].to(self.device)) * (len(x) / self.cfg.global_batch)
            self.loss += out.detach().cpu()
        else:
            self._send(self._message(a), out)
        self.held[a.stage, a.microbatch] = [x, out, None]
        self.peak = max(self.peak, len(self.held))

    def _backward(self, a: Action) -> None:
        _, k = direction_of(a.stage, self.P)
        x, out, _ = entry = self.held[a.stage, a.microbatch]
        grad = None if k == self.P - 1 else self._take(("gradient", a.stage, a.microbatch))
        if (a.stage, a.microbatch) not in self.split:
            out.backward(grad)
            del self.held[a.stage, a.microbatch]
            grad_x = x.grad
        elif k > 0:
            (grad_x,) = torch.autograd.grad(out, x, grad, retain_graph=True)
        entry[2] = grad
        if k > 0:
            self._send(self._message(a), grad_x)

    def _weight(self, a: Action) -> None:
        _, out, grad = self.held.pop((a.stage, a.microbatch))
        torch.autograd.backward(out, grad, inputs=list(self.mine[a.stage].module.parameters()))

    def _sum_mirrors(self) -> None:
        """One exchange with the mirror rank: both chunks' gradients, in chunk order, then the sum."""
        by_chunk = sorted(self.mine.values(), key=lambda s: s.index)
        grads = [p.grad for s in by_chunk for p in s.module.parameters()]
        mine = torch.cat([g.reshape(-1) for g in grads])
        theirs = torch.empty_like(mine)
        for work in dist.batch_isend_irecv(
            [dist.P2POp(dist.isend, mine, self.mirror), dist.P2POp(dist.irecv, theirs, self.mirror)]
        ):
            work.wait()
        total = mine + theirs
        for g, part in zip(grads, torch.split(total, [g.numel() for g in grads])):
            g.copy_(part.view_as(g))
