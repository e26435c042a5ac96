"""Messages between stages: which activation or gradient goes to which rank, batched so that no
schedule deadlocks.

A tensor that crosses a process boundary leaves its autograd graph behind: the receiver gets plain
numbers. Stage p + 1 therefore marks a received activation `requires_grad_()`, so that its backward
yields dL/dA_p, and sends that gradient back; stage p resumes its backward from it. Two stages on
the same rank (the turn of a V, or P = 1) hand the tensor over locally, cut from the graph the same
way, with no message. The receiver allocates the buffer from the shapes `partition.boundary_shapes`
derives; no shape is ever sent.

Why batches, and which. With blocking send/recv, 1F1B deadlocks: on P = 2, rank 0 finishes F1 and
sends its activation while rank 1 finishes I0 and sends its gradient; each `send` waits for the other
side's `recv` (gloo's send waits for the matching receive even for ten numbers; NCCL's once its
buffers are full). Posting the sends alone with `isend` is not enough on GPUs either: NCCL runs the
transfers between two ranks on one stream, in posting order. The cure, which torch.distributed.
pipelining uses too, is to post matching sends and receives together, in one
`dist.batch_isend_irecv` (one NCCL group: its transfers progress together), and wait for the batch:
the ground floor's exchange, `distlab.comm.p2p.post`.

Which transfers go together comes from the schedule's own grid (`simulator.simulate`): a message
travels at the tick its producer finishes. Every rank posts, just before each of its actions, one
batch with every transfer of the ticks since its previous action started: what it has just
computed, and what its peers computed meanwhile. Both sides of a message post it for the same tick,
in the same order (tick, then message), so the k-th message one rank sends another is the k-th that
one receives, on every transport (NCCL ignores tags); and no rank waits for a transfer its peer
could only post after waiting for it: a stuck rank would wait on a tick its peer has not reached,
whose peer would wait on an earlier tick, and so on down to tick 0. Receiving a message before it is
needed costs a buffer, nothing else. `comm_plan` writes the batches down as data; the tests replay
every rank's plan against the others for every schedule, P <= 6 and M <= 13.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

from distlab.comm.p2p import post
from distlab.model_split.schedules import Action, Schedule, num_stages, rank_of
from distlab.model_split.simulator import Timing, simulate


@dataclass(frozen=True)
class Transfer:
    """One message: this rank sends to or receives from `peer` the activation entering `stage`, or
    the gradient of `stage`'s output, for `microbatch`."""

    op: str  # 'send' or 'recv'
    peer: int
    what: str  # 'activation' or 'gradient'
    microbatch: int
    stage: int  # the stage that consumes it

    @property
    def message(self) -> tuple[str, int, int]:
        return self.what, self.stage, self.microbatch


def produces(action: Action, stages: int) -> tuple[str, int] | None:
    """(what, consuming stage) that `action` hands on: F its output, I its input's gradient."""
    if action.kind == "F" and action.stage < stages - 1:
        return "activation", action.stage + 1
    if action.kind == "I" and action.stage > 0:
        return "gradient", action.stage - 1
    return None


def comm_plan(schedule: Schedule, rank: int, timing: Timing | None = None) -> list[list[Transfer]]:
    """len(actions) + 1 batches for `rank`: batch n is posted and completed just before action n
    computes; the last one, after the last action, flushes the last sends. (`timing`: the
    schedule's `simulate`d grid, when the caller has it already.)"""
    timing = timing or simulate(schedule)
    stages, where, actions = num_stages(schedule), rank_of(schedule), schedule[rank]
    starts = [timing.start[a] for a in actions]
    batches: list[list[tuple[int, Transfer]]] = [[] for _ in range(len(actions) + 1)]
    for producer, order in enumerate(schedule):
        for a in order:
            made = produces(a, stages)
            if made is None or where[made[1]] == producer or rank not in (producer, where[made[1]]):
                continue  # nothing leaves the rank, or the message is none of this rank's business
            tick = timing.finish[a]
            if producer == rank:
                t = Transfer("send", where[made[1]], made[0], a.microbatch, made[1])
            else:
                t = Transfer("recv", producer, made[0], a.microbatch, made[1])
            slot = bisect.bisect_left(starts, tick)  # before the first own action starting at or after it
            batches[slot].append((tick, t))
    return [[t for _, t in sorted(batch, key=lambda e: (e[0], e[1].message, e[1].op))] for batch in batches]


def exchange(
    sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Size, int]], dtype: torch.dtype, device: torch.device
) -> list[torch.Tensor]:
    """Post every send (tensor, dst) and receive (shape, src) at once, wait for all of them, and
    return the received tensors in the order of `recvs` (in buffers allocated from their shapes)."""
    buffers = [(torch.empty(shape, dtype=dtype, device=device), src) for shape, src in recvs]
    return post([(t.detach(), dst) for t, dst in sends], buffers).wait()
