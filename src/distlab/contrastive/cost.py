"""What a contrastive step costs each rank: logits, memory, communication (lesson 23).

Logits. Global x global (lesson 21): one N x N matmul per rank (N^2 entries), then a softmax over
its rows and one over its columns (2 N^2 exponentials). Local x global: the C x N rows of S and the
C x N rows of S^T, two matmuls of 2 C N = 2 N^2 / P entries in all, and softmaxes over just those
(2 C N exponentials: P times fewer). No tensor is bigger than C x N. At P = 2 the matmul work is
the same as global x global; the softmax work and the largest tensor are already halved.

Communication per rank, per gathered N x d tensor (two per step: z_x and z_y), counted in elements
as a ring algorithm moves them (each rank sends and receives this many; the fractions are
`distlab.comm.collectives`'):

    forward all_gather               (P-1)/P * N d
    backward all_reduce             2(P-1)/P * N d    (a reduce-scatter and an all-gather)
    backward reduce_scatter          (P-1)/P * N d

The all-reduce's second half gives every rank the summed gradient of every block, of which it keeps
only its own: the reduce-scatter is the same answer with half the traffic. That is how NCCL runs them;
gloo runs reduce_scatter_tensor as an all-reduce of a copy (see `distlab.contrastive.gather`), so the
measured CPU times do not show the saving.
"""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist

from distlab.comm import compat
from distlab.comm.collectives import ring_fraction
from distlab.contrastive.variants import Variant
from distlab.processes.identity import Runtime
from distlab.proof.memory import PeakMemory
from distlab.proof.timeline import timed


def ring_elements(world: int, n: int, d: int) -> dict[str, float]:
    """Elements each rank sends (= receives) per gathered N x d tensor, for a ring of P ranks."""
    return {
        f"{kind} ({direction})": float(ring_fraction(kind, world) * n * d)
        for kind, direction in (("all_gather", "forward"), ("all_reduce", "backward"), ("reduce_scatter", "backward"))
    }


def global_logits(n: int) -> dict[str, int]:
    """Global x global, per rank: the N x N matmul's entries, and the entries its row and column
    softmaxes exponentiate."""
    return {"matmul": n * n, "softmax": 2 * n * n}


def local_logits(n: int, world: int) -> dict[str, int]:
    """Local x global, per rank: the C x N rows of S and of S^T, each with its row softmax."""
    return {"matmul": 2 * (n // world) * n, "softmax": 2 * (n // world) * n}


def _slowest(seconds: list[float], rt: Runtime) -> float:
    """The median of this rank's times, maximised over ranks (a step waits for its slowest rank)."""
    slowest = torch.tensor([statistics.median(seconds)], dtype=torch.float64, device=rt.device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return slowest.item()


def loss_cost(
    rt: Runtime, z_x: torch.Tensor, z_y: torch.Tensor, tau: float, variant: Variant, repeats: int = 5
) -> dict[str, float]:
    """Largest single tensor and peak extra bytes of this rank's loss forward + backward (from its
    embeddings on), and the median seconds over `repeats` runs (slowest rank)."""
    z_x, z_y = z_x.detach().requires_grad_(), z_y.detach().requires_grad_()

    def once() -> None:
        loss, _ = variant(rt, z_x, z_y, tau)
        loss.backward()
        z_x.grad = z_y.grad = None

    once()  # warm-up: first-call allocations and connections
    with PeakMemory() as mem:
        once()
    seconds = []
    for _ in range(repeats):
        dist.barrier()
        seconds.append(timed(once, rt.device))  # on a GPU: the work, not the launches
    return {"largest_bytes": mem.largest_bytes, "peak_bytes": mem.peak_bytes, "seconds": _slowest(seconds, rt)}


def collective_seconds(rt: Runtime, n: int, d: int, dtype: torch.dtype, repeats: int = 10) -> dict[str, float]:
    """Median seconds (slowest rank) of the backward collectives on one N x d gradient."""
    device = rt.device
    grad = torch.randn(n, d, dtype=dtype, device=device)
    mine = torch.empty(n // rt.world_size, d, dtype=dtype, device=device)
    ops = {
        "all_reduce (backward)": lambda: dist.all_reduce(grad.clone()),
        "reduce_scatter (backward)": lambda: compat.reduce_scatter_single(mine, grad),
    }
    out = {}
    for name, op in ops.items():
        op()  # warm-up
        seconds = []
        for _ in range(repeats):
            dist.barrier()
            seconds.append(timed(op, device))
        out[name] = _slowest(seconds, rt)
    return out
