"""Point-to-point transfer of activations (forward) and their gradients (backward) between stages.

A tensor that crosses a process boundary leaves its autograd graph behind: the receiver gets plain
numbers. Stage s+1 therefore marks the received activation `requires_grad_()` so that its backward
produces d loss / d input, and sends that gradient back; stage s resumes backpropagation from its
output with `output.backward(received_grad)`. That is the chain rule across the cut:
    dL/dW_s = (dL/dA_s) (dA_s/dW_s),  with dL/dA_s computed on rank s+1.

The receiver allocates the buffer, so it must know the shape: callers pass the shape derived by
`partition.boundary_shapes` (no shape is ever sent or hard-coded).

`send`/`recv` block, which is all lesson 01 needs. A pipeline with many micro-batches in flight
needs `comm_plan` and `exchange` (below): why is explained there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from distlab.pipeline.schedules import Action


def send(tensor: torch.Tensor, dst: int) -> None:
    """Blocking send of the numbers of `tensor` (never its graph)."""
    dist.send(tensor.detach().contiguous(), dst=dst)


def recv(shape: torch.Size, dtype: torch.dtype, device: torch.device, src: int,
         requires_grad: bool = False) -> torch.Tensor:
    """Blocking receive into a fresh buffer; `requires_grad=True` makes it a leaf that collects
    d loss / d (this tensor) during this stage's backward."""
    buffer = torch.empty(shape, dtype=dtype, device=device)
    dist.recv(buffer, src=src)
    return buffer.requires_grad_(requires_grad)


# ---------------------------------------------------------------------------------------------
# Many micro-batches in flight: a communication plan, and batched non-blocking exchange
# ---------------------------------------------------------------------------------------------
#
# With blocking send/recv, 1F1B deadlocks. On P = 2, rank 0 finishes F1 and sends its activation
# while rank 1 finishes B0 and sends its gradient: each `send` waits for the other side's `recv`,
# and neither ever gets there. (gloo's send is a rendezvous even for ten numbers: it waits for the
# matching receive; NCCL's does once its buffers are full.) Posting the sends on their own with
# `isend` is not enough on GPUs either: NCCL runs every transfer between two ranks on one stream,
# in posting order, so rank 0's [send F1, recv B0] and rank 1's [send B0, recv F1] still wait on
# each other. The cure, which torch.distributed.pipelining uses too: keep the sends an action
# produced, and post them *together* with the receives the next action needs, in one
# `dist.batch_isend_irecv` (one NCCL group, so all of its transfers progress at once), then wait
# for all of them. `comm_plan` writes down exactly which transfers go into each batch, as data,
# so the tests can replay every rank's plan against the others and prove that no schedule deadlocks.


@dataclass(frozen=True)
class Transfer:
    """One message: this rank sends to or receives from `peer` the activation (forward) or the
    gradient (backward) of `microbatch`."""

    op: str       # 'send' or 'recv'
    peer: int
    what: str     # 'activation' or 'gradient'
    microbatch: int


def _produces(action: Action, stage: int, num_stages: int) -> list[Transfer]:
    """What `action` sends once computed: F sends its output on, B the gradient of its input back."""
    if action.kind == "F" and stage < num_stages - 1:
        return [Transfer("send", stage + 1, "activation", action.microbatch)]
    if action.kind == "B" and stage > 0:
        return [Transfer("send", stage - 1, "gradient", action.microbatch)]
    return []


def _needs(action: Action, stage: int, num_stages: int) -> list[Transfer]:
    """What `action` must receive before it can compute."""
    if action.kind == "F" and stage > 0:
        return [Transfer("recv", stage - 1, "activation", action.microbatch)]
    if action.kind == "B" and stage < num_stages - 1:
        return [Transfer("recv", stage + 1, "gradient", action.microbatch)]
    return []


def comm_plan(actions: list[Action], stage: int, num_stages: int) -> list[list[Transfer]]:
    """len(actions) + 1 batches: batch n is posted and completed just before action n computes
    (the sends of action n-1 with the receives of action n); the last batch, after the last
    action, flushes its sends."""
    batches, pending = [], []
    for action in actions:
        batches.append(pending + _needs(action, stage, num_stages))
        pending = _produces(action, stage, num_stages)
    batches.append(pending)
    return batches


def exchange(sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Size, int]],
             dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """Post every send (tensor, dst) and receive (shape, src) at once, wait for all of them, and
    return the received tensors in the order of `recvs`."""
    buffers = [torch.empty(shape, dtype=dtype, device=device) for shape, _ in recvs]
    ops = [dist.P2POp(dist.isend, t.detach().contiguous(), dst) for t, dst in sends]
    ops += [dist.P2POp(dist.irecv, buf, src) for buf, (_, src) in zip(buffers, recvs)]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return buffers


def losses_from_last_stage(losses: list[float], steps: int, device: torch.device) -> list[float]:
    """Every step's loss, on every rank. Only the last stage computes it; one broadcast at the end
    shares the whole list (not one per step, which would add a synchronisation to every step)."""
    last = dist.get_world_size() - 1
    shared = torch.tensor(losses if dist.get_rank() == last else [0.0] * steps,
                          dtype=torch.float64, device=device)
    dist.broadcast(shared, src=last)
    return shared.tolist()
