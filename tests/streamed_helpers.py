"""What the streamed step's tests share (tests/test_streamed_*.py): a small CLIP-like model, its
full-batch reference through the library's `clip_loss` / `sigmoid_loss` (plain autograd over the whole
N x N, none of the streamed step's code) and `as_ranks`, each rank's dropout stream and
its rows. (tests/helpers.py holds what every test shares; this one what the streamed tests do.)"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from distlab.contrastive.losses import clip_loss, sigmoid_loss  # plain autograd: independent of streamed/
from distlab.contrastive.reference import RankStreams, as_ranks
from distlab.pieces.chunks import balanced_chunks

STREAMED_N = 24  # a global batch divisible by P = 1, 2, 3 and 4
DROPOUT_SEED = 100  # rank r's dropout stream starts from torch.manual_seed(DROPOUT_SEED + r)


class Towers(nn.Module):
    """Two small towers (Linear, [BatchNorm], Tanh, Dropout, Linear) with L2-normalised outputs and,
    with `scale_shape`, a learnable logit scale s = exp(logit_scale) returned third (open_clip's way);
    embeddings of `width` (d, 8 unless given).
    `float32_out` names the towers whose embeddings leave the model in float32 (under autocast)."""

    def __init__(
        self, scale_shape=None, dropout=0.0, batchnorm=False, dtype=torch.float64, float32_out=(), seed=0, width=8
    ):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)

        def tower(dim_in):
            layers = [nn.Linear(dim_in, 16, dtype=dtype)] + ([nn.BatchNorm1d(16, dtype=dtype)] if batchnorm else [])
            layers += [nn.Tanh(), nn.Dropout(dropout), nn.Linear(16, width, dtype=dtype)]
            with torch.no_grad():
                for p in (q for layer in layers for q in layer.parameters()):
                    p.copy_(torch.randn(p.shape, generator=gen, dtype=dtype) * 0.4)
            return nn.Sequential(*layers)

        self.encoder_x, self.encoder_y = tower(12), tower(10)
        self.float32_out = float32_out
        if scale_shape is not None:
            self.logit_scale = nn.Parameter(torch.full(scale_shape, math.log(1 / 0.07), dtype=dtype))

    def forward(self, x, y):
        z_x, z_y = F.normalize(self.encoder_x(x), dim=-1), F.normalize(self.encoder_y(y), dim=-1)
        z_x, z_y = (z.float() if name in self.float32_out else z for z, name in ((z_x, "x"), (z_y, "y")))
        return (z_x, z_y) if not hasattr(self, "logit_scale") else (z_x, z_y, self.logit_scale.exp())


def full_batch(model, x, y, world, b, tau=None, streams=None):
    """`clip_loss` of the whole global batch, with a graph into `model`: each rank's pairs cut into
    micro-batches as the step cuts them (`balanced_chunks`, what `StreamConfig.micro` uses), rank r's
    dropout drawn from `streams` (a RankStreams; fixed seeds when None); the scale s = 1/tau, or the
    model's own as an ordinary tensor."""
    c = len(x) // world
    streams = streams if streams is not None else RankStreams(range(world))
    z_x, z_y, *scale = as_ranks(streams, balanced_chunks(c, min(b, c)))(model, x, y)
    if len(scale) == 2:  # (s, beta): the sigmoid loss
        return sigmoid_loss(z_x, z_y, *scale)
    return clip_loss(z_x, z_y, scale[0] if tau is None else 1 / tau)


class SigTowers(Towers):
    """Towers with SigLIP's head: a learnable logit scale s = exp(logit_scale) (init 10) and logit bias
    beta (init -10, open_clip's init_logit_bias), returned as (z_x, z_y, s, beta), or with `as_dict` as
    open_clip's output_dict."""

    def __init__(self, as_dict=False, scale_shape=(), **kwargs):
        super().__init__(scale_shape=scale_shape, **kwargs)
        with torch.no_grad():
            self.logit_scale.fill_(math.log(10.0))
        self.logit_bias = nn.Parameter(torch.full(scale_shape, -10.0, dtype=self.logit_scale.dtype))
        self.as_dict = as_dict

    def forward(self, x, y):
        z_x, z_y, s = super().forward(x, y)
        if self.as_dict:
            return {"image_features": z_x, "text_features": z_y, "logit_scale": s, "logit_bias": self.logit_bias}
        return z_x, z_y, s, self.logit_bias


def rank_streams(world, seed=DROPOUT_SEED):
    """Rank r's dropout stream as `torch.manual_seed(seed + r)` starts it (carried on across steps)."""
    return RankStreams([seed + r for r in range(world)])


def local_rows(rt, n=STREAMED_N):
    c = n // rt.world_size
    return slice(rt.rank * c, (rt.rank + 1) * c)
