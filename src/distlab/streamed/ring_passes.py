"""The ring exchange: feature blocks pass rank to rank, so no rank ever holds N x d.

Rank r keeps its own C rows z_x^r, z_y^r. At step k = 0 ... P-1 it holds the visiting column block
j = (r - k) mod P: its features (C x d, sent on to r + 1 *before* the tile math that reads them, so
the message overlaps the arithmetic) and a traveling accumulator for block j (what the ranks visited
so far have added into j's columns, sent on *after* this rank folds its share in). The accumulator of
block j leaves rank j at step 0 and, after P hops, is back home, complete. Per rank, in elements:

    features   (P - 1) C d                     (P - 1 hops: the last holder keeps them)
    accumulator P m                            (P hops, m elements each, the last one home)

Two passes give the exact InfoNCE gradient with 4 C N d multiply-adds per rank (the gathered design
does 6 C N d: it streams S once for a and b, then twice more, once for G_x's rows and once for G_y's):

  pass 1  S tile by tile; each tile folds into this rank's row (m, l) (its a_i) and into the visiting
          block's column (m, l) (b_j's partials, the accumulator: m = 2C). C N d.
  pass 2  S again, and with a and b_j the coefficients R + Q - 2 delta (= 2N dL/dS);
          G_x += (R + Q - 2 delta) z_y^j for my rows, and the accumulator ((R + Q - 2 delta)^T z_x^r
          for block j's columns, m = C d) carries G_y home. b_j travels with z_y^j. 3 C N d.

The sigmoid ring is one pass (no normaliser): the text blocks travel as in open_clip's `shift`
variant, and the accumulator D^T z_x carries G_y home (open_clip's autograd sends the same numbers
back around the ring in its backward). 3 C N d.

Each rank folds the ranks' contributions in arrival order, so its partial (a fresh tile's sums) is
merged with the received accumulator only after the tile math: the accumulator's message, like the
features', is in flight while the tiles run. `P2PRing` sends with the ground floor's exchange
(`distlab.comm.ring.Ring.shift`: one batch_isend_irecv, over the wrapper's group); `ListRing` plays P
ranks in one process (threads and queues, the same code path, the same `Posted` waiter).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from distlab.comm.ledger import Ledger
from distlab.comm.p2p import Posted
from distlab.comm.ring import Ring
from distlab.pieces.online_softmax import merge
from distlab.streamed.kernel_choice import as_tile_ops
from distlab.streamed.sigmoid import Logits, RankGrads
from distlab.streamed.torch_tiles import Pairing, RowFold, lse_and_nll
from distlab.streamed.wrappers import compute_dtype


@dataclass
class Endpoint:
    """One rank's view of the ring: whom it sends to, what it sent (counted), and what happened when."""

    world: int
    rank: int  # in `group`
    group: object = None  # the process group (None: the world)
    ledger: Ledger = field(default_factory=Ledger)
    events: list[tuple[int, str, float]] = field(default_factory=list)  # (step, what, when), in order

    def log(self, step: int, what: str) -> None:
        self.events.append((step, what, time.perf_counter()))


class P2PRing(Endpoint):
    """The real ring: send to r + 1 and receive from r - 1 with point-to-point messages."""

    def shift(self, tensors: list[torch.Tensor], tag: int) -> Posted:
        return Ring(self.group, self.ledger).shift(*tensors, tag=tag)


class ListRing(Endpoint):
    """One of P ranks played by a thread of one process: mailboxes (queues) per (tag, receiving rank)."""

    def __init__(self, world: int, rank: int, mail: dict):
        super().__init__(world, rank)
        self.mail = mail

    def shift(self, tensors: list[torch.Tensor], tag: int) -> Posted:
        self.ledger.count_sends(tensors)
        self.mail[tag, (self.rank + 1) % self.world].put([t.clone() for t in tensors])
        return Posted(self.mail[tag, self.rank].get)  # delivered when the left neighbour has posted


def run_in_threads(world: int, body: Callable[[ListRing], object]) -> tuple[list, list[ListRing]]:
    """Run body(endpoint) for P ranks at once, one thread each; their results and endpoints."""
    mail = {(tag, r): queue.Queue() for tag in (0, 1) for r in range(world)}
    ends = [ListRing(world, r, mail) for r in range(world)]
    results: list = [None] * world
    errors: list = []

    def run(r: int) -> None:
        try:
            results[r] = body(ends[r])
        except Exception as err:  # noqa: BLE001 - re-raised below, on the caller's thread
            errors.append(err)
            for r2 in range(world):  # unblock the others
                for tag in (0, 1):
                    mail[tag, r2].put(None)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]
    return results, ends


AHEAD, ACC = 0, 1  # message tags: the visiting features, the traveling accumulator


def ring_pass(
    ring: Endpoint,
    ahead: list[torch.Tensor],
    visit: Callable[[int, list[torch.Tensor]], list[torch.Tensor]],
    merge: Callable[[list, list], list],
) -> list[torch.Tensor]:
    """Walk every column block past this rank; returns this rank's own block's accumulator, complete.

    visit(owner, ahead) runs the tile math of my rows against block `owner` and returns its fresh
    partial accumulator; merge(received, partial) folds it into what the earlier ranks sent."""
    world, rank = ring.world, ring.rank
    incoming = None
    for k in range(world):
        owner = (rank - k) % world
        posted = None
        if k < world - 1:  # the features go on before the math
            posted = ring.shift(ahead, AHEAD)
            ring.log(k, f"post block {owner} -> {(rank + 1) % world}")
        ring.log(k, f"begin tiles {rank} x {owner}")
        partial = visit(owner, ahead)
        ring.log(k, f"end tiles {rank} x {owner}")
        acc = partial if incoming is None else merge(incoming.wait(), partial)
        incoming = ring.shift(acc, ACC) if world > 1 else Posted(acc)
        del partial, acc  # only the message holds them now: a rank keeps no block longer than it must
        if world > 1:
            ring.log(k, f"post acc {owner} -> {(rank + 1) % world}")
        if posted is not None:
            ahead = posted.wait()
            ring.log(k, f"got block {(rank - k - 1) % world}")
    return incoming.wait()


def expected_ring_bytes(world: int, c: int, d: int, itemsize: int, loss: str) -> int:
    """What each rank sends in the ring, in bytes (features and accumulators in the compute dtype)."""
    if world == 1:
        return 0
    if loss == "sigmoid":
        return itemsize * ((world - 1) * c * d + world * c * d)
    pass_1 = (world - 1) * c * d + world * 2 * c
    pass_2 = (world - 1) * (c * d + c) + world * c * d
    return itemsize * (pass_1 + pass_2)


def _merge_lse(received: list, partial: list) -> list:
    """Two column (m, l) partials of the online fold, merged into one (the ground floor's `merge`)."""
    return list(merge(*received, *partial))


def _add(received: list, partial: list) -> list:
    return [r.add_(p) for r, p in zip(received, partial)]


def infonce_ring(ring: Endpoint, x: torch.Tensor, y: torch.Tensor, s: float, tiles) -> RankGrads:
    """This rank's share of the symmetric InfoNCE and its gradients, from its own C x d z_x, z_y and
    the two ring passes (4 C N d with the torch tiles, 5 with the kernels: `kernel_choice`). g_y is for this
    rank's own C columns (= its pairs' z_y). `tiles`: a TileOps, or T (the torch tiles)."""
    c, n, me, tiles = len(x), len(x) * ring.world, ring.rank, as_tile_ops(tiles)
    kw = dict(dtype=compute_dtype(x.dtype), device=x.device)
    fold = RowFold(
        torch.full((c,), float("-inf"), **kw), torch.zeros(c, **kw), torch.empty(c, **kw), torch.empty(c, **kw)
    )

    def lse_partials(owner: int, ahead: list) -> list:  # pass 1: S once, C N d
        return tiles.ring_fold(x, ahead[0], s, fold, owner == me)

    col_m, col_l = ring_pass(ring, [y], lse_partials, _merge_lse)
    a, nll_x = lse_and_nll(fold.m, fold.l, fold.diag_rows)
    b, nll_y = lse_and_nll(col_m, col_l, fold.diag_cols)
    coef = torch.expm1(-nll_x) + torch.expm1(-nll_y)  # R_ii + Q_ii - 2, no cancellation
    pair_y = torch.zeros(x.shape, **kw)  # (R + Q - 2 delta) z_y for my rows

    def products(owner: int, ahead: list) -> list:  # pass 2: S and its two products
        (y_j, b_j) = ahead
        return [tiles.ring_products(x, y_j, s, Pairing(a, b_j, coef, 0 if owner == me else None), pair_y)]

    (pair_x,) = ring_pass(ring, [y, b], products, _add)  # (R + Q - 2 delta)^T z_x for my columns
    scale = s / (2 * n)
    return RankGrads(
        (nll_x + nll_y).sum() / (2 * n), pair_y * scale, pair_x * scale, (x * pair_y).sum() / (2 * n), None
    )


def sigmoid_ring(ring: Endpoint, x: torch.Tensor, y: torch.Tensor, logits: Logits, tiles) -> RankGrads:
    """This rank's share of the sigmoid loss and its gradients from one ring pass (3 C N d with the torch
    tiles, 4 with the kernels): the text blocks travel, D^T z_x rides with them and carries G_y home.
    `tiles`: a TileOps, or T (the torch tiles)."""
    c, n, me, tiles = len(x), len(x) * ring.world, ring.rank, as_tile_ops(tiles)
    kw = dict(dtype=compute_dtype(x.dtype), device=x.device)
    own = {"loss": torch.zeros((), **kw), "d_y": torch.zeros(x.shape, **kw), "d_sum": torch.zeros((), **kw)}

    def visit(owner: int, ahead: list) -> list:
        blk = tiles.sigmoid_block(x, ahead[0], logits, (me * c, owner * c), n, (True, True))
        own["loss"] += blk.loss_sum
        own["d_y"] += blk.d_y
        own["d_sum"] += blk.d_sum
        return [blk.d_x]

    (d_x,) = ring_pass(ring, [y], visit, _add)
    s = logits.s
    return RankGrads(own["loss"] / n, own["d_y"] * s, d_x * s, (x * own["d_y"]).sum(), own["d_sum"])
