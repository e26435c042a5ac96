"""The loss machineries benchmarks/clip_step.py times: this rank's C x d embeddings in, dL/dZ for its
rows out, no encoder. Every call has the signature (z_x, z_y, rt, chunk, method).

InfoNCE (tau = 0.07):
  open_clip recipe     ClipLoss(local_loss=True, gather_with_grad=True): the sum-backward gather
                       (lesson 23), the C x N local loss, autograd; dL/dZ / P (DDP averages P losses)
  streamed, B = C      the library's `loss_machinery` with EXCHANGE "gather": the all-gather,
  streamed, B = C/8    phase 2, phase 3 per micro-batch (6 C N d)
  streamed ring        `loss_machinery` with EXCHANGE "ring": two passes around the ring (4 C N d)
  6 / 4 C N d floor    the same multiply-adds as plain mm on N x d stand-ins, in the T x T tiles the
                       streamed step walks: the gathered design's 6 (2 for S's rows and columns,
                       2 x 2 for G's tiles and products) and the ring's 4 (1 for S, then S and its two
                       products with z_y and z_x); no exponentials, no reductions, no communication. Not a gradient.
Sigmoid (s = 10, beta = -10, SigLIP's initial values):
  SigLipLoss bidir     open_clip's recipe (`distlab.contrastive.siglip_recipe`), text blocks passed to
  SigLipLoss gather    both neighbours or all-gathered, autograd through the exchange; s and beta
                       require grad, as open_clip's parameters do
  streamed sigmoid     `loss_machinery` with a logit bias, EXCHANGE "gather" (4 C N d) or "ring"
  streamed sigmoid,    (3 C N d); T x T tiles, nothing C x N
  ring
"""

from __future__ import annotations

import torch

from distlab.contrastive.gather import gather_with_grad
from distlab.contrastive.losses import local_clip_loss
from distlab.contrastive.siglip_recipe import siglip_recipe_loss
from distlab.pieces.chunks import chunks
from distlab.streamed import loss_machinery

TAU, S_SIGMOID, BETA = 0.07, 10.0, -10.0
OPEN_CLIP, B_EQ_C, B_C8, RING = "open_clip recipe", "streamed, B = C", "streamed, B = C/8", "streamed ring"
FLOOR, FLOOR_4 = "6 C N d floor", "4 C N d floor"
BIDIR, SIG_GATHER = "SigLipLoss bidir", "SigLipLoss gather"
SIGMOID, SIGMOID_RING = "streamed sigmoid", "streamed sigmoid, ring"


def config(n: int, micro: int, chunk: int, exchange: str = "gather") -> dict:
    return {
        "GLOBAL_BATCH_SIZE": n,
        "MICRO_BATCH_SIZE": micro,
        "STREAM_CHUNK_SIZE": chunk,
        "TAU": TAU,
        "EXCHANGE": exchange,
    }


def micro_of(method: str, c: int) -> int:
    return max(1, c // 8) if method == B_C8 else c


def open_clip_loss(z_x, z_y, rt):
    """open_clip's ClipLoss(local_loss=True, gather_with_grad=True): this rank's C x N local loss on the
    sum-backward gather; its backward under DDP is the exact gradient."""
    return local_clip_loss(z_x, z_y, gather_with_grad(z_x), gather_with_grad(z_y), 1 / TAU, rt.rank * len(z_x))


def loss_open_clip(z_x, z_y, rt, chunk, method):
    lx, ly = z_x.clone().requires_grad_(), z_y.clone().requires_grad_()
    open_clip_loss(lx, ly, rt).backward()
    return lx.grad / rt.world_size, ly.grad / rt.world_size


def loss_streamed(z_x, z_y, rt, chunk, method):
    c = len(z_x)
    exchange = "ring" if method in (RING, SIGMOID_RING) else "gather"
    bias = BETA if method in (SIGMOID, SIGMOID_RING) else None
    cfg = config(c * rt.world_size, micro_of(method, c), chunk, exchange)
    if bias is not None:
        cfg["TAU"] = 1 / S_SIGMOID
    _, g_x, g_y = loss_machinery(z_x, z_y, cfg, logit_bias=bias)
    return g_x, g_y


def loss_siglip_recipe(z_x, z_y, rt, chunk, method):
    lx, ly = z_x.clone().requires_grad_(), z_y.clone().requires_grad_()
    s, b = (torch.tensor(v, dtype=z_x.dtype, device=z_x.device, requires_grad=True) for v in (S_SIGMOID, BETA))
    siglip_recipe_loss(lx, ly, s, b, "bidir" if method == BIDIR else "gather").backward()
    return lx.grad / rt.world_size, ly.grad / rt.world_size


def _stand_ins(z_x, z_y, rt):
    """N x d stand-ins for the gathered (or, in the ring, visiting) embeddings, and zeroed G_x, G_y."""
    return z_x.repeat(rt.world_size, 1), z_y.repeat(rt.world_size, 1), torch.zeros_like(z_x), torch.zeros_like(z_y)


def _tiles(c: int, n: int, t: int):
    """(rows, cols) of the T x T tiles of a C x N block, as the streamed step walks them."""
    return [(rows, cols) for rows in chunks(c, t) for cols in chunks(n, t)]


def floor_6(z_x, z_y, rt, chunk, method):
    """6 C N d multiply-adds as plain mm in T x T tiles, the gathered design's (not a gradient)."""
    k_x, k_y, g_x, g_y = _stand_ins(z_x, z_y, rt)
    for rows, cols in _tiles(len(z_x), len(k_x), chunk):  # phase 2's 2 C N d: my rows and my columns of S
        torch.mm(z_x[rows], k_y[cols].T)
        torch.mm(z_y[rows], k_x[cols].T)
    for rows, cols in _tiles(len(z_x), len(k_x), chunk):  # phase 3's 4 C N d: a tile and its product
        g_x[rows].addmm_(torch.mm(z_x[rows], k_y[cols].T), k_y[cols])
        g_y[rows].addmm_(torch.mm(z_y[rows], k_x[cols].T), k_x[cols])
    return g_x, g_y


def floor_4(z_x, z_y, rt, chunk, method):
    """4 C N d multiply-adds as plain mm in T x T tiles, the ring's (not a gradient): S once, then S and its two
    products (G_x's rows, the visiting block's accumulator)."""
    _, k_y, g_x, _ = _stand_ins(z_x, z_y, rt)
    acc = torch.zeros_like(k_y)  # the visiting blocks' accumulators, N x d
    for rows, cols in _tiles(len(z_x), len(k_y), chunk):  # pass 1: C N d
        torch.mm(z_x[rows], k_y[cols].T)
    for rows, cols in _tiles(len(z_x), len(k_y), chunk):  # pass 2: 3 C N d
        w = torch.mm(z_x[rows], k_y[cols].T)
        g_x[rows].addmm_(w, k_y[cols])
        acc[cols].addmm_(w.T, z_x[rows])
    return g_x, acc[: len(z_x)]


INFONCE = {
    OPEN_CLIP: loss_open_clip,
    B_EQ_C: loss_streamed,
    B_C8: loss_streamed,
    RING: loss_streamed,
    FLOOR: floor_6,
    FLOOR_4: floor_4,
}
SIGMOIDS = {
    BIDIR: loss_siglip_recipe,
    SIG_GATHER: loss_siglip_recipe,
    SIGMOID: loss_streamed,
    SIGMOID_RING: loss_streamed,
}
FLOORS = (FLOOR, FLOOR_4)
BASE = {"step": OPEN_CLIP, "loss": OPEN_CLIP, "sigmoid": BIDIR}  # what each part's ratios are taken against
