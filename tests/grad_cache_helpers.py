"""What the GradCache tests share (tests/test_grad_cache*.py): the loss on raw representations, the
single-process reference (plain autograd on deep copies, chunks replayed in order when dropout is on), and a
toy VLM with its text and image batches."""

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from distlab.contrastive.grad_cache import default_rep
from distlab.contrastive.losses import clip_loss
from distlab.proof.compare import grads_of

N, TAU, SEED = 13, 0.1, 7


def rep_clip_loss(rep_x, rep_y, tau=TAU):
    """The CLIP loss on raw representations: GradCache caches dL/d(rep), normalisation included."""
    return clip_loss(F.normalize(rep_x, dim=-1), F.normalize(rep_y, dim=-1), 1 / tau)


def call(model, chunk):
    return model(**chunk) if isinstance(chunk, dict) else model(chunk)


def reference(models, batches, loss_fn, chunked_batches=None, seed=SEED):
    """Plain autograd on deep copies; `chunked_batches` (with dropout) replays the chunk order."""
    copies = {id(m): copy.deepcopy(m) for m in models}
    torch.manual_seed(seed)
    if chunked_batches is None:
        reps = [default_rep(call(copies[id(m)], b)) for m, b in zip(models, batches)]
    else:
        reps = [
            torch.cat([default_rep(call(copies[id(m)], c)) for c in chunks])
            for m, chunks in zip(models, chunked_batches)
        ]
    loss = loss_fn(*reps)
    loss.backward()
    grads = {}
    for i, m in enumerate(dict.fromkeys(models)):  # distinct models, in order
        grads.update(grads_of(copies[id(m)], prefix=f"model{i}."))
    return grads, loss.detach()


def grads_of_models(models):
    grads = {}
    for i, m in enumerate(dict.fromkeys(models)):
        grads.update(grads_of(m, prefix=f"model{i}."))
    return grads


def rows(batch, chunk):
    return [batch[a : a + chunk] for a in range(0, len(batch), chunk)]


@dataclass
class Output:
    """A HF-like model output: the representation is found by name, never by `a or b`."""

    last_hidden_state: torch.Tensor
    pooler_output: torch.Tensor | None = None


class ToyVLM(nn.Module):
    """Text (token ids + mask) and, when given, one image per sample as flattened patches, Qwen-VL
    style: image i owns t*h*w consecutive rows of pixel_values. Mean-pools both, then a head."""

    def __init__(self, vocab=11, patch_dim=5, hidden=16, embed=6, dropout=0.0, pooled=True):
        super().__init__()
        gen = torch.Generator().manual_seed(3)
        self.tokens = nn.Embedding(vocab, hidden, dtype=torch.float64)
        self.patch = nn.Linear(patch_dim, hidden, dtype=torch.float64)
        self.head = nn.Sequential(nn.Tanh(), nn.Dropout(dropout), nn.Linear(hidden, embed, dtype=torch.float64))
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.5)
        self.pooled = pooled

    def forward(self, input_ids, attention_mask, pixel_values=None, image_grid_thw=None):
        mask = attention_mask.unsqueeze(-1).to(torch.float64)
        h = (self.tokens(input_ids) * mask).sum(1) / mask.sum(1)
        if pixel_values is not None:
            counts = image_grid_thw.prod(1).tolist()
            h = h + torch.stack([p.mean(0) for p in self.patch(pixel_values).split(counts)])
        out = self.head(h)
        if self.pooled:
            return Output(last_hidden_state=out.unsqueeze(1).expand(-1, 3, -1), pooler_output=out)
        return Output(last_hidden_state=torch.cat([out.unsqueeze(1), torch.zeros_like(out).unsqueeze(1)], 1))


def text_batch(n, seed, length=7, vocab=11):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, length + 1, (n,), generator=gen)
    return {
        "input_ids": torch.randint(0, vocab, (n, length), generator=gen),
        "attention_mask": (torch.arange(length) < lengths[:, None]).long(),
    }


def image_batch(n, seed, patch_dim=5):
    gen = torch.Generator().manual_seed(seed + 100)
    grid = torch.stack(
        [
            torch.ones(n, dtype=torch.long),
            torch.randint(1, 3, (n,), generator=gen),
            torch.randint(1, 4, (n,), generator=gen),
        ],
        dim=1,
    )  # 1 to 6 patches per image
    pixels = torch.randn(int(grid.prod(1).sum()), patch_dim, generator=gen, dtype=torch.float64)
    return {**text_batch(n, seed), "pixel_values": pixels, "image_grid_thw": grid}
