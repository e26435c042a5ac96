"""A stock-like open_clip `CLIP` written out small, its single-process reference, and open_clip's own
`--accum-freq` step, for the tests that drop such a model into `distributed_clip` unchanged.

`CLIP` keeps open_clip's layout and nothing else: `visual` (a trunk, a dropout standing in for patch
dropout, `ln_post` and the projection `proj`, as open_clip's VisionTransformer holds it), `transformer`
(one residual attention block under the causal `attn_mask`, sequence-first), `token_embedding`,
`positional_embedding`, `ln_final`, `text_projection`, `logit_scale` (and `logit_bias` when asked
for). `forward(image, text)` returns (image_features, text_features, logit_scale.exp()) normalised,
or with `output_dict=True` open_clip's dict. No `encoder_x` / `encoder_y`.

`open_clip_recipe` is open_clip's `ClipLoss` on one rank, each combination of its `local_loss` and
`gather_with_grad` flags (the migration tests measure what each gives under DDP).

`accum_freq_backward` is open_clip_train's `train_one_epoch` for `--accum-freq k` (src/open_clip_train/
train.py): a no-grad forward of each of the k batches caches their features; then, per batch j, one
forward with grad whose features replace batch j's in the cache, the loss of all k batches
(`ClipLoss(local_loss=True, gather_with_grad=True)`) and its full `backward()`, DDP reducing only in
the last. Its encoder gradient is the sum over j of the loss's gradient through batch j's features,
the exact gradient when the recompute reproduces the cached features; its logit scale enters each
of the k losses with grad, so it receives k times dL/ds.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from distlab.contrastive.gather import all_gather_blocks, gather_plain, gather_with_grad
from distlab.contrastive.reference import RankStreams, as_ranks, full_batch_gradients
from distlab.pieces.chunks import balanced_chunks

IMAGE_DIM, WIDTH, EMBED, VOCAB, CONTEXT = 12, 16, 8, 20, 5


class Visual(nn.Module):
    """The image tower: trunk, dropout (open_clip's patch dropout draws a new mask per forward, as
    this does), ln_post, and the projection parameter `proj` inside the tower."""

    def __init__(self, dropout: float):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(IMAGE_DIM, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH))
        self.patch_dropout = nn.Dropout(dropout)
        self.ln_post = nn.LayerNorm(WIDTH)
        self.proj = nn.Parameter(torch.randn(WIDTH, EMBED) * WIDTH**-0.5)

    def forward(self, image):
        return self.ln_post(self.patch_dropout(self.trunk(image))) @ self.proj


class Transformer(nn.Module):
    """One pre-norm residual attention block, sequence-first, open_clip's ResidualAttentionBlock."""

    def __init__(self):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.attn = nn.MultiheadAttention(WIDTH, 2)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))

    def forward(self, x, attn_mask=None):
        y = self.ln_1(x)
        x = x + self.attn(y, y, y, need_weights=False, attn_mask=attn_mask)[0]
        return x + self.mlp(self.ln_2(x))


class CLIP(nn.Module):
    """open_clip's CLIP, small: float64, deterministic in `seed`."""

    def __init__(self, output_dict=False, dropout=0.0, logit_bias=None, seed=0, nonscalar_logit_scale=False):
        super().__init__()
        shape = [1] if nonscalar_logit_scale else []  # open_clip's create_model(..., nonscalar_logit_scale=True)
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            self.output_dict = output_dict
            self.visual = Visual(dropout)
            self.transformer = Transformer()
            self.token_embedding = nn.Embedding(VOCAB, WIDTH)
            self.positional_embedding = nn.Parameter(torch.randn(CONTEXT, WIDTH) * 0.1)
            self.ln_final = nn.LayerNorm(WIDTH)
            self.text_projection = nn.Parameter(torch.randn(WIDTH, EMBED) * WIDTH**-0.5)
            self.logit_scale = nn.Parameter(torch.ones(shape) * math.log(1 / 0.07))
            self.logit_bias = nn.Parameter(torch.ones(shape) * logit_bias) if logit_bias is not None else None
        self.register_buffer("attn_mask", torch.full((CONTEXT, CONTEXT), float("-inf")).triu_(1), persistent=False)
        self.double()

    def encode_image(self, image, normalize: bool = False):
        features = self.visual(image)
        return F.normalize(features, dim=-1) if normalize else features

    def encode_text(self, text, normalize: bool = False):
        x = self.token_embedding(text) + self.positional_embedding  # batch x CONTEXT x WIDTH
        x = self.transformer(x.permute(1, 0, 2), attn_mask=self.attn_mask).permute(1, 0, 2)
        x = self.ln_final(x)
        x = x[torch.arange(x.shape[0]), text.argmax(dim=-1)] @ self.text_projection  # the EOT token
        return F.normalize(x, dim=-1) if normalize else x

    def forward(self, image=None, text=None):
        image_features = self.encode_image(image, normalize=True) if image is not None else None
        text_features = self.encode_text(text, normalize=True) if text is not None else None
        if self.output_dict:
            out = {
                "image_features": image_features,
                "text_features": text_features,
                "logit_scale": self.logit_scale.exp(),
            }
            if self.logit_bias is not None:
                out["logit_bias"] = self.logit_bias
            return out
        if self.logit_bias is not None:
            return image_features, text_features, self.logit_scale.exp(), self.logit_bias
        return image_features, text_features, self.logit_scale.exp()


def freeze_backbones(model: CLIP) -> CLIP:
    """Both backbones locked, as a fine-tuning run does; the projections (`visual.proj`,
    `text_projection`), `ln_final`, the embeddings and `logit_scale` still train."""
    model.visual.requires_grad_(False)
    model.visual.proj.requires_grad_(True)
    model.transformer.requires_grad_(False)
    return model


def image_text_data(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """n images (float64 vectors) and n token sequences whose largest token is the EOT."""
    gen = torch.Generator().manual_seed(seed)
    images = torch.randn(n, IMAGE_DIM, generator=gen, dtype=torch.float64)
    texts = torch.randint(1, VOCAB - 1, (n, CONTEXT), generator=gen)
    texts[torch.arange(n), torch.randint(1, CONTEXT, (n,), generator=gen)] = VOCAB - 1
    return images, texts


def as_tuple(out) -> tuple:
    """(image_features, text_features, logit_scale) of either output form."""
    if isinstance(out, dict):
        return out["image_features"], out["text_features"], out["logit_scale"]
    return tuple(out[:3])


def reference(model: CLIP, images, texts, world: int, b: int, streams: RankStreams | None = None):
    """(loss, gradients by name of the parameters that train) of the whole batch on a deep copy, plain
    autograd (`full_batch_gradients`): each rank's pairs in the micro-batches the step cuts, rank r's
    dropout masks from `streams` (`as_ranks`), the model's own scale."""
    c = len(images) // world
    ranks = as_ranks(streams if streams is not None else RankStreams(range(world)), balanced_chunks(c, min(b, c)))
    loss, grads = full_batch_gradients(
        model, images, texts, None, forward=lambda copy, x, y: ranks(lambda *xy: as_tuple(copy(*xy)), x, y)
    )
    return loss, {n: grads[n] for n, p in model.named_parameters() if p.requires_grad}


def grads_by_name(model: nn.Module) -> dict[str, torch.Tensor]:
    """The gradients that exist (a frozen parameter has none), by name."""
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def open_clip_recipe(image_features, text_features, logit_scale, local_loss: bool, with_grad: bool):
    """open_clip's `ClipLoss(local_loss, gather_with_grad)` on this rank (src/open_clip/loss.py: its
    `gather_features`, then `ClipLoss.forward`), every combination of the two flags. The gather: with
    grad, an all-gather whose backward sums over ranks (`torch.distributed.nn.all_gather`'s); without,
    a plain all-gather, this rank's block put back with its graph unless local_loss. The loss: with
    local_loss this rank's C rows against every column (labels offset by C rank), else all N x N."""
    world, rank, c = dist.get_world_size(), dist.get_rank(), len(image_features)
    if world == 1:
        all_image, all_text = image_features, text_features
    elif with_grad:
        all_image, all_text = gather_with_grad(image_features), gather_with_grad(text_features)
    elif local_loss:
        all_image, all_text = all_gather_blocks(image_features.detach()), all_gather_blocks(text_features.detach())
    else:
        all_image, all_text = gather_plain(image_features), gather_plain(text_features)
    if local_loss:
        labels = torch.arange(c) + c * rank
        logits_per_image = logit_scale * image_features @ all_text.T
        logits_per_text = logit_scale * text_features @ all_image.T
    else:
        labels = torch.arange(len(all_image))
        logits_per_image = logit_scale * all_image @ all_text.T
        logits_per_text = logits_per_image.T
    return (F.cross_entropy(logits_per_image, labels) + F.cross_entropy(logits_per_text, labels)) / 2


def accum_freq_backward(ddp, batches: list) -> float:
    """open_clip_train's --accum-freq step on this rank's k = len(batches) batches (see the module
    docstring); the model returns open_clip's dict. Returns the last loss."""
    cached: dict[str, list] = {}
    with torch.no_grad():
        for images, texts in batches:
            out = ddp(images, texts)
            for key in ("logit_scale", "logit_bias"):
                out.pop(key, None)
            for key, val in out.items():
                cached.setdefault(key, []).append(val)
    for j, (images, texts) in enumerate(batches):
        last = j == len(batches) - 1
        with contextlib.nullcontext() if last else ddp.no_sync():
            out = ddp(images, texts)
            logit_scale = out.pop("logit_scale")
            inputs = {key: torch.cat(val[:j] + [out[key]] + val[j + 1 :]) for key, val in cached.items()}
            loss = open_clip_recipe(inputs["image_features"], inputs["text_features"], logit_scale, True, True)
            loss.backward()
    return loss.item()
