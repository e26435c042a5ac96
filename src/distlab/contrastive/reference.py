"""The single-process references of the contrastive track: no process group, no gather.

`full_batch_gradients(model, x, y, s)` is the reference every exact step is checked against: a deep
copy of the model, the whole global batch, plain autograd on a loss of the N embeddings (`clip_loss`
with logit scale s = 1/tau unless told otherwise; s = None: the scale the model returns third, open_clip's
learned one). Two things vary it:

- `loss_fn`: `sigmoid_loss` for a model that returns (z_x, z_y, s, beta) (SigLIP's; s = None passes
  both). `DetachedBlocks(P)` is what lesson 22's plain gather really computes, written out in
  one process without any of its code: split the batch into P blocks; for block r, the symmetric
  loss over block r's rows in which only block r's embeddings carry gradient (the other blocks are
  detached constants); average over r. Its gradient is

      1/P * sum_r dL_r/dz_r * dz_r/dtheta,

  the true gradient 1/P * sum_r sum_s dL_s/dz_r * dz_r/dtheta without the s != r terms.
- `forward`: how the N embeddings are made. With dropout, a distributed step's embeddings depend on
  which random stream drew each mask: rank r runs its C pairs from its own stream, in its own
  micro-batches and order. `as_ranks(RankStreams(seeds), micro)` replays exactly that in one process,
  "the full-batch reference with each rank's dropout replayed", where `micro` is each rank's cut into
  micro-batches as the step cuts it (the streamed step's `config.micro`, balanced; GradCache's
  `chunks(C, B)`):

      full_batch_gradients(model, x, y, s, forward=as_ranks(RankStreams(seeds), micro))

  `tower_by_tower=True` replays GradCache's order (a rank's x micro-batches through `encoder_x`,
  then its y micro-batches through `encoder_y`); the default runs `model(x_b, y_b)` per
  micro-batch (the streamed step's order). A `RankStreams` carries each stream on from where its
  last use left it, as a rank's stream does from one step to the next.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from distlab.contrastive.losses import check_scale, clip_loss
from distlab.proof.compare import grads_of

Embeddings = tuple  # (Z_x, Z_y), or (Z_x, Z_y, s) from a model that returns its logit scale
LossFn = Callable[..., torch.Tensor]  # (Z_x, Z_y, s) -> L, or (Z_x, Z_y, s, beta) -> L
Forward = Callable[[nn.Module, torch.Tensor, torch.Tensor], Embeddings]  # (model, X, Y) -> embeddings


def plain_forward(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Embeddings:
    return model(x, y)


def full_batch_gradients(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    s: float | None,
    loss_fn: LossFn = clip_loss,
    forward: Forward = plain_forward,
) -> tuple[float, dict[str, torch.Tensor]]:
    """(L, dL/dtheta) of a deep copy of `model` on the whole batch (the original is untouched), the copy
    on the batch's device (a caller may hold the model still on the host); with
    s None the model's own scale (returned third by its forward) is used, and its gradient included,
    and so is anything it returns after the scale (SigLIP's bias beta: loss_fn(Z_x, Z_y, s, beta))."""
    model = copy.deepcopy(model).to(x.device)
    model.zero_grad(set_to_none=True)
    z_x, z_y, *scale = forward(model, x, y)
    loss = loss_fn(z_x, z_y, *(scale if s is None else (s,)))
    loss.backward()
    return loss.item(), grads_of(model)


# -- what the plain gather computes (lesson 22) -------------------------------------------------


def _only_block_carries_grad(z: torch.Tensor, rows: slice) -> torch.Tensor:
    """Same values as z; gradient flows only into z[rows]."""
    mask = torch.zeros(len(z), 1, dtype=z.dtype, device=z.device)
    mask[rows] = 1
    return z.detach() + mask * (z - z.detach())


def detached_blocks_loss(z_x: torch.Tensor, z_y: torch.Tensor, s: float, world_size: int) -> torch.Tensor:
    """1/P * sum_r (block r's rows of the symmetric loss, every other block's embeddings detached).

    Its value is the global loss L; its gradient is what DDP with the plain gather computes.
    """
    check_scale(s)
    n = len(z_x)
    if n % world_size:
        raise ValueError(f"N = {n} must split evenly into {world_size} blocks")
    c = n // world_size
    labels = torch.arange(n, device=z_x.device)
    total = z_x.new_zeros(())
    for r in range(world_size):
        rows = slice(r * c, (r + 1) * c)
        zx_r, zy_r = _only_block_carries_grad(z_x, rows), _only_block_carries_grad(z_y, rows)
        logits = s * zx_r @ zy_r.T
        # Block r's rows of S (x -> y) and of S^T (y -> x), the mean over its C rows.
        total = (
            total + (F.cross_entropy(logits[rows], labels[rows]) + F.cross_entropy(logits.T[rows], labels[rows])) / 2
        )
    return total / world_size


class DetachedBlocks:
    """`detached_blocks_loss` for a fixed P, as a loss of (Z_x, Z_y, s) (picklable, unlike a lambda)."""

    def __init__(self, world_size: int):
        self.world_size = world_size

    def __call__(self, z_x: torch.Tensor, z_y: torch.Tensor, s: float) -> torch.Tensor:
        return detached_blocks_loss(z_x, z_y, s, self.world_size)


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


def as_ranks(streams: RankStreams, micro: Sequence[slice] | None = None, tower_by_tower: bool = False) -> Forward:
    """The forward P ranks run, in one process: rank r's share (rows rC ... rC + C - 1, C = N / P)
    from rank r's stream, in its micro-batches `micro` (local rows, cut as the step cuts them; the
    whole share when None), in order; the embeddings concatenated in rank order, and the scale the
    model returns third, if it does (every rank's is the same)."""

    def forward(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Embeddings:
        p = len(streams)
        if len(x) % p:
            raise ValueError(f"the global batch N = {len(x)} must split evenly over P = {p} ranks")
        c = len(x) // p
        parts = micro if micro is not None else [slice(0, c)]
        outs_x, outs_y, scale = [], [], []
        for r in range(p):
            x_r, y_r = x[r * c : (r + 1) * c], y[r * c : (r + 1) * c]
            with streams.stream(r, x.device):
                if tower_by_tower:  # GradCache: all of tower x's micro-batches, then tower y's
                    outs_x += [F.normalize(model.encoder_x(x_r[rows]), dim=-1) for rows in parts]
                    outs_y += [F.normalize(model.encoder_y(y_r[rows]), dim=-1) for rows in parts]
                    continue
                for rows in parts:
                    z_x, z_y, *scale = model(x_r[rows], y_r[rows])
                    outs_x.append(z_x)
                    outs_y.append(z_y)
        return (torch.cat(outs_x), torch.cat(outs_y), *scale)

    return forward
