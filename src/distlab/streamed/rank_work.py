"""One rank's tile work at a P-rank shape, without the exchange: to count a step's launches and bytes on the
meta device (nothing is computed, so N = 65,536 counts on a laptop) and to time one rank's share of a large
step on one device.

Rank r of P does the same tile work whatever the other ranks' embeddings hold, so N x d stand-ins take their
place: the gathered Z_x, Z_y (InfoNCE: phase 2's row folds and phase 3's products for every micro-batch, with
a and b repeated for the other ranks' rows; sigmoid: `sigmoid_gathered`), or, in the ring, each visiting block
is the rank's own (`Loopback`: the ring's walk of P visits, every message handed straight back). The functions
are the step's own (`step`, `ring`, `sigmoid`); only the exchanges are left out.
"""

from __future__ import annotations

import torch

from distlab.comm.p2p import Posted
from distlab.proof.launch_count import LaunchCount
from distlab.streamed.config import StreamConfig
from distlab.streamed.exchange import sigmoid_gathered
from distlab.streamed.kernel_choice import TileOps, tile_ops
from distlab.streamed.precision import pinned
from distlab.streamed.ring_passes import Endpoint, infonce_ring, sigmoid_ring
from distlab.streamed.sigmoid import Logits
from distlab.streamed.step import Embedded, Normalisers, own_normalisers, phase3_embedding_grads
from distlab.streamed.wrappers import compute_dtype

TAU, S_SIGMOID, BETA = 0.07, 10.0, -10.0  # CLIP's temperature; SigLIP's initial scale and bias


class Loopback(Endpoint):
    """A ring of P in one process: every block sent comes straight back as the next one to visit."""

    def shift(self, tensors: list[torch.Tensor], tag: int) -> Posted:
        self.ledger.count_sends(tensors)
        return Posted(list(tensors))


def one_rank(cfg: StreamConfig, z_x: torch.Tensor, z_y: torch.Tensor, loss: str, ops: TileOps) -> tuple:
    """Rank cfg.rank's tile work on N x d stand-ins Z_x, Z_y (its own rows where the step would have them):
    (G_x, G_y) for its C rows, as the step computes them, no exchange."""
    own, dtype = slice(cfg.offset, cfg.offset + cfg.local), compute_dtype(z_x.dtype, z_y.dtype)
    with pinned(ops.precision, z_x.device.type):
        if cfg.exchange == "ring":  # the ring's blocks travel in the compute dtype (`exchange.rank_shares`)
            x, y = (ops.prepare(z[own].to(dtype)).contiguous() for z in (z_x, z_y))
            ring = Loopback(cfg.world, cfg.rank)
            shares = (
                sigmoid_ring(ring, x, y, Logits(S_SIGMOID, BETA), ops)
                if loss == "sigmoid"
                else infonce_ring(ring, x, y, 1 / TAU, ops)
            )
            return shares.g_x, shares.g_y
        z_x, z_y = ops.prepare(z_x), ops.prepare(z_y)  # as the gather hands them over (`step.gather_embeddings`)
        if loss == "sigmoid":
            shares = sigmoid_gathered(z_x, z_y, Logits(S_SIGMOID, BETA), own, ops)
            return shares.g_x, shares.g_y
        emb = Embedded(z_x, z_y, 1 / TAU)
        a_own, nll_x, b_own, nll_y = own_normalisers(emb, cfg, ops)
        norm = Normalisers(
            a_own.repeat(cfg.world), b_own.repeat(cfg.world), torch.expm1(-nll_x) + torch.expm1(-nll_y), 0.0
        )
    grads = [phase3_embedding_grads(emb, norm, rows, cfg, (True, True, False), ops)[:2] for rows in cfg.micro]
    return torch.cat([g[0] for g in grads]), torch.cat([g[1] for g in grads])


def count_rank(cfg: StreamConfig, loss: str, d: int, dtype: torch.dtype) -> LaunchCount:
    """The launches and bytes of one rank's step at cfg's shape, counted on the meta device (T: the config's
    STREAM_CHUNK_SIZE, which the torch tiles need here; the kernels ignore it)."""
    meta = torch.device("meta")
    z_x, z_y = (torch.empty(cfg.n, d, dtype=dtype, device=meta) for _ in range(2))
    ops = tile_ops(cfg.kernels, cfg.precision, cfg.t or 1, meta, dtype, d, cfg.w_budget)
    with LaunchCount() as count:
        one_rank(cfg, z_x, z_y, loss, ops)
    return count
