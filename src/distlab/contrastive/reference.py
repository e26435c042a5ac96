"""The single-process references of the contrastive track: no process group, no gather.

`full_batch_gradients(model, x, y, tau)` is the reference every exact step is checked against: a
deep copy of the model, the whole global batch, plain autograd on a loss of the N embeddings
(`clip_loss` unless told otherwise). Two things vary it:

- `loss_fn`: `detached_blocks(P)` is what lesson 11's plain gather really computes, written out in
  one process without any of its code: split the batch into P blocks; for block r, the symmetric
  loss over block r's rows in which only block r's embeddings carry gradient (the other blocks are
  detached constants); average over r. Its gradient is

      1/P * sum_r dL_r/dz_r * dz_r/dtheta,

  the true gradient 1/P * sum_r sum_s dL_s/dz_r * dz_r/dtheta without the s != r terms.
- `forward`: how the N embeddings are made. With dropout, a distributed step's embeddings depend on
  which random stream drew each mask: rank r runs its C pairs from its own stream, in its own
  micro-batches and order. `as_ranks(RankStreams(seeds), B)` replays exactly that in one process,
  "the full-batch reference with each rank's dropout replayed" (lessons 13 and 14 and their tests):

      full_batch_gradients(model, x, y, tau, forward=as_ranks(RankStreams(seeds), B))

  `tower_by_tower=True` replays GradCache's order (a rank's x micro-batches through `encoder_x`,
  then its y micro-batches through `encoder_y`); the default runs `model(x_b, y_b)` per
  micro-batch (the streamed step's order). A `RankStreams` carries each stream on from where its
  last use left it, as a rank's stream does from one step to the next.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager
from typing import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from distlab.compare import grads_of
from distlab.contrastive.losses import check_temperature, clip_loss

Embeddings = tuple[torch.Tensor, torch.Tensor]
LossFn = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]   # (Z_x, Z_y, tau) -> L
Forward = Callable[[nn.Module, torch.Tensor, torch.Tensor], Embeddings]  # (model, X, Y) -> (Z_x, Z_y)


def plain_forward(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Embeddings:
    return model(x, y)


def full_batch_gradients(model: nn.Module, x: torch.Tensor, y: torch.Tensor, tau: float,
                         loss_fn: LossFn = clip_loss,
                         forward: Forward = plain_forward) -> tuple[float, dict[str, torch.Tensor]]:
    """(L, dL/dtheta) of a deep copy of `model` on the whole batch (the original is untouched)."""
    model = copy.deepcopy(model)
    model.zero_grad(set_to_none=True)
    loss = loss_fn(*forward(model, x, y), tau)
    loss.backward()
    return loss.item(), grads_of(model)


# -- what the plain gather computes (lesson 11) -------------------------------------------------


def _only_block_carries_grad(z: torch.Tensor, rows: slice) -> torch.Tensor:
    """Same values as z; gradient flows only into z[rows]."""
    mask = torch.zeros(len(z), 1, dtype=z.dtype, device=z.device)
    mask[rows] = 1
    return z.detach() + mask * (z - z.detach())


def detached_blocks_loss(z_x: torch.Tensor, z_y: torch.Tensor, tau: float, world_size: int) -> torch.Tensor:
    """1/P * sum_r (block r's rows of the symmetric loss, every other block's embeddings detached).

    Its value is the global loss L; its gradient is what DDP with the plain gather computes.
    """
    check_temperature(tau)
    n = len(z_x)
    if n % world_size:
        raise ValueError(f"N = {n} must split evenly into {world_size} blocks")
    c = n // world_size
    labels = torch.arange(n, device=z_x.device)
    total = z_x.new_zeros(())
    for r in range(world_size):
        rows = slice(r * c, (r + 1) * c)
        zx_r, zy_r = _only_block_carries_grad(z_x, rows), _only_block_carries_grad(z_y, rows)
        s = zx_r @ zy_r.T / tau
        # Block r's rows of S (x -> y) and of S^T (y -> x), the mean over its C rows.
        total = total + (F.cross_entropy(s[rows], labels[rows]) + F.cross_entropy(s.T[rows], labels[rows])) / 2
    return total / world_size


class DetachedBlocks:
    """`detached_blocks_loss` for a fixed P, as a loss of (Z_x, Z_y, tau) (picklable, unlike a lambda)."""

    def __init__(self, world_size: int):
        self.world_size = world_size

    def __call__(self, z_x: torch.Tensor, z_y: torch.Tensor, tau: float) -> torch.Tensor:
        return detached_blocks_loss(z_x, z_y, tau, self.world_size)


# -- each rank's dropout, replayed in one process -----------------------------------------------


class RankStreams:
    """P ranks' global random streams in one process: rank r's starts as `torch.manual_seed(seeds[r])`
    would start it, and goes on from where its last use left it."""

    def __init__(self, seeds: Sequence[int]):
        self.seeds = list(seeds)
        self.states: list[torch.Tensor | None] = [None] * len(self.seeds)

    def __len__(self) -> int:
        return len(self.seeds)

    @contextmanager
    def stream(self, rank: int, device: torch.device) -> Iterator[None]:
        """Run the block from rank `rank`'s stream; the caller's own stream is left as it was."""
        cuda = device.type == "cuda"
        with torch.random.fork_rng(devices=[device] if cuda else []):
            if self.states[rank] is None:
                torch.manual_seed(self.seeds[rank])
            elif cuda:
                torch.cuda.set_rng_state(self.states[rank], device)
            else:
                torch.set_rng_state(self.states[rank])
            yield
            self.states[rank] = torch.cuda.get_rng_state(device) if cuda else torch.get_rng_state()


def _micro_batches(n: int, b: int | None) -> list[slice]:
    b = b or n
    return [slice(i, min(i + b, n)) for i in range(0, n, b)]


def as_ranks(streams: RankStreams, micro_batch_size: int | None = None, tower_by_tower: bool = False) -> Forward:
    """The forward P ranks run, in one process: rank r's share (rows rC ... rC + C - 1, C = N / P)
    from rank r's stream, in micro-batches of B rows in order (the whole share when B is None);
    the embeddings concatenated in rank order."""

    def forward(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Embeddings:
        p = len(streams)
        if len(x) % p:
            raise ValueError(f"the global batch N = {len(x)} must split evenly over P = {p} ranks")
        c, parts_x, parts_y = len(x) // p, [], []
        for r in range(p):
            x_r, y_r = x[r * c:(r + 1) * c], y[r * c:(r + 1) * c]
            with streams.stream(r, x.device):
                if tower_by_tower:  # GradCache: all of tower x's micro-batches, then tower y's
                    parts_x += [F.normalize(model.encoder_x(x_r[s]), dim=-1) for s in _micro_batches(c, micro_batch_size)]
                    parts_y += [F.normalize(model.encoder_y(y_r[s]), dim=-1) for s in _micro_batches(c, micro_batch_size)]
                else:
                    for s in _micro_batches(c, micro_batch_size):
                        z_x, z_y = model(x_r[s], y_r[s])
                        parts_x.append(z_x)
                        parts_y.append(z_y)
        return torch.cat(parts_x), torch.cat(parts_y)

    return forward
