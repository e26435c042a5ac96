"""A real, tiny CLIP: scikit-learn's handwritten digits paired with captions, two small towers.

The data ships inside scikit-learn (`sklearn.datasets.load_digits`: 1,797 grey 8 x 8 images of the
digits 0-9, about 180 of each, read from the package; nothing is downloaded). Each training image is
paired with one caption in words ("a photo of the digit seven", "a handwritten seven", ...), drawn
from a few templates, so the text tower must learn that only the number word matters.

- `load_split`: images scaled to [-1, 1] and a stratified train / held-out split, the same on every
  rank (a seeded generator, no global random state).
- `Tokenizer`: a word-level vocabulary of the captions, padded to one length (id 0 is padding). The
  point of the lesson is the training, not NLP: every caption word is in the vocabulary by
  construction. `caption_table` tokenises every (digit, template) caption once; `draw_captions`
  picks a template per image, afresh each epoch.
- `DigitsCLIP`: `encoder_x` (images: two small convolutions, then a linear map), `encoder_y` (text:
  token + position embeddings, mean over the caption's words, an MLP) and a learnable
  `logit_scale`; `forward(x, y)` returns (z_x, z_y, s) with unit-norm embeddings and s =
  exp(logit_scale), open_clip's `CLIP.forward` contract, so `distributed_backward` trains the scale.
  With `logit_bias` (SigLIP's head) it also learns a bias beta and returns (z_x, z_y, s, beta), which
  selects the sigmoid loss; its scale then starts at s = 10 (open_clip's SigLIP configs).
- `zero_shot`: CLIP's zero-shot classifier: each image against the ten class captions of a prompt
  template that no training caption uses (`ZERO_SHOT_TEMPLATE`), top-1; with `confusion_matrix` to
  see which digits it confuses.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

CLASS_NAMES = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
TEMPLATES = (
    "a photo of the digit {}",
    "a handwritten {}",
    "the number {} written by hand",
    "a blurry scan of the digit {}",
    "a small grey picture of the number {}",
    "the digit {} written with a pen",
)
# The zero-shot prompt is a sentence no training caption uses (held out like the images), made of words
# the training captions taught the text tower.
ZERO_SHOT_TEMPLATE = "the handwritten digit {}"
assert ZERO_SHOT_TEMPLATE not in TEMPLATES
INIT_LOGIT_SCALE = math.log(1 / 0.07)  # CLIP's initial temperature, tau = 0.07
MAX_LOGIT_SCALE = math.log(100)  # CLIP clamps s at 100 (tau >= 0.01) after every step
SIGLIP_INIT_LOGIT_SCALE = math.log(10)  # SigLIP's s = 10 at the start, with the bias beta = -10
SIGLIP_INIT_LOGIT_BIAS = -10.0  # (open_clip's init_logit_scale / init_logit_bias for SigLIP)


@dataclass(frozen=True)
class DigitsSplit:
    """Images (n x 1 x 8 x 8, in [-1, 1]) and labels (0-9) of the training and held-out sets."""

    train_images: torch.Tensor
    train_labels: torch.Tensor
    test_images: torch.Tensor
    test_labels: torch.Tensor


def load_split(test_fraction: float = 0.2, seed: int = 0, dtype: torch.dtype = torch.float32) -> DigitsSplit:
    """scikit-learn's digits, split per class so both sets hold every digit in proportion."""
    from sklearn.datasets import load_digits  # imported here: only the digits lessons need sklearn

    if not 0 < test_fraction < 1:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    bunch = load_digits()
    images = torch.as_tensor(bunch.images, dtype=dtype).unsqueeze(1) / 8 - 1  # pixel values 0..16
    labels = torch.as_tensor(bunch.target, dtype=torch.long)
    gen = torch.Generator().manual_seed(seed)
    test = torch.zeros(len(labels), dtype=torch.bool)
    for digit in range(len(CLASS_NAMES)):
        members = (labels == digit).nonzero().squeeze(1)
        chosen = members[torch.randperm(len(members), generator=gen)]
        test[chosen[: round(test_fraction * len(members))]] = True
    return DigitsSplit(images[~test], labels[~test], images[test], labels[test])


def caption(label: int, template: str = ZERO_SHOT_TEMPLATE) -> str:
    return template.format(CLASS_NAMES[label])


def caption_table(tokenizer: Tokenizer) -> torch.Tensor:
    """Token ids of every caption: classes x templates x length (tokenised once, indexed per step)."""
    texts = [caption(label, t) for label in range(len(CLASS_NAMES)) for t in TEMPLATES]
    return tokenizer.encode(texts).view(len(CLASS_NAMES), len(TEMPLATES), -1)


def draw_captions(labels: torch.Tensor, table: torch.Tensor, seed: int) -> torch.Tensor:
    """One caption per image (n x length ids), its template drawn afresh from `seed`. Drawn again
    every epoch, or the image tower memorises which template each training image came with (the
    loss keeps falling, and zero-shot accuracy with one fixed template falls with it)."""
    gen = torch.Generator().manual_seed(seed)
    return table[labels, torch.randint(table.shape[1], (len(labels),), generator=gen)]


class Tokenizer:
    """Words to ids: lower-case, split on spaces; 0 pads, every word of the captions has an id."""

    PAD = 0

    def __init__(self, captions: Sequence[str]):
        words = sorted({w for text in captions for w in text.lower().split()})
        self.vocab = {w: i + 1 for i, w in enumerate(words)}
        self.length = max(len(text.split()) for text in captions)

    def __len__(self) -> int:
        return len(self.vocab) + 1

    def encode(self, captions: Sequence[str]) -> torch.Tensor:
        """len(captions) x length token ids, right-padded with 0."""
        ids = torch.full((len(captions), self.length), self.PAD, dtype=torch.long)
        for row, text in enumerate(captions):
            words = text.lower().split()
            unknown = [w for w in words if w not in self.vocab]
            if unknown or len(words) > self.length:
                raise ValueError(
                    f"caption {text!r} has words {unknown} outside the vocabulary or more than {self.length} words"
                )
            ids[row, : len(words)] = torch.tensor([self.vocab[w] for w in words])
        return ids

    @classmethod
    def for_digits(cls) -> Tokenizer:
        """The vocabulary of every template and every digit name (the zero-shot prompt's words among them)."""
        return cls([caption(label, t) for t in (*TEMPLATES, ZERO_SHOT_TEMPLATE) for label in range(len(CLASS_NAMES))])


class ImageTower(nn.Module):
    """1 x 8 x 8 -> 32 x 8 x 8 -> 64 x 4 x 4 (stride 2) -> d."""

    def __init__(self, dim: int, width: int = 32):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1),
            nn.GELU(),
            nn.Conv2d(width, 2 * width, 3, stride=2, padding=1),
            nn.GELU(),
            nn.Flatten(),
            nn.LayerNorm(2 * width * 16),
        )
        self.proj = nn.Linear(2 * width * 16, dim)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.proj(self.features(images))


class TextTower(nn.Module):
    """Token + position embeddings, averaged over the caption's words (padding masked out), an MLP."""

    def __init__(self, vocab_size: int, length: int, dim: int, width: int = 64):
        super().__init__()
        self.tokens = nn.Embedding(vocab_size, width, padding_idx=Tokenizer.PAD)
        self.positions = nn.Parameter(torch.randn(length, width) * 0.02)
        self.mlp = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        words = (ids != Tokenizer.PAD).unsqueeze(-1)  # n x L x 1
        h = (self.tokens(ids) + self.positions) * words  # n x L x width
        return self.mlp(h.sum(1) / words.sum(1).clamp_min(1))


class DigitsCLIP(nn.Module):
    """The two towers and the learnable logit scale; forward(x, y) -> (z_x, z_y, s). With `logit_bias`
    (e.g. SIGLIP_INIT_LOGIT_BIAS) a learnable bias too, s starting at 10: forward -> (z_x, z_y, s, beta).
    The towers' initial weights depend on `seed` only, bias or not."""

    def __init__(
        self,
        vocab_size: int,
        length: int,
        dim: int = 64,
        width: int = 32,
        seed: int = 0,
        logit_bias: float | None = None,
    ):
        super().__init__()
        with torch.random.fork_rng():  # the same initial weights on every rank; the global stream untouched
            torch.manual_seed(seed)
            self.encoder_x = ImageTower(dim, width)
            self.encoder_y = TextTower(vocab_size, length, dim, 2 * width)
        sigmoid = logit_bias is not None
        self.logit_scale = nn.Parameter(torch.tensor(SIGLIP_INIT_LOGIT_SCALE if sigmoid else INIT_LOGIT_SCALE))
        self.logit_bias = nn.Parameter(torch.tensor(float(logit_bias))) if sigmoid else None

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        z_x = F.normalize(self.encoder_x(x), dim=-1)
        z_y = F.normalize(self.encoder_y(y), dim=-1)
        if self.logit_bias is None:
            return z_x, z_y, self.logit_scale.exp()
        return z_x, z_y, self.logit_scale.exp(), self.logit_bias

    @torch.no_grad()
    def clamp_logit_scale_(self) -> None:
        """After each optimiser step, as open_clip does: s stays in [1, 100] (SigLIP's too; beta is free)."""
        self.logit_scale.clamp_(0, MAX_LOGIT_SCALE)


@torch.no_grad()
def zero_shot(
    model: DigitsCLIP,
    images: torch.Tensor,
    labels: torch.Tensor,
    tokenizer: Tokenizer,
    template: str = ZERO_SHOT_TEMPLATE,
) -> tuple[float, torch.Tensor]:
    """(top-1 accuracy, predicted labels): each image's nearest of the ten class captions by cosine."""
    was_training = model.training
    model.eval()
    classes = tokenizer.encode([caption(k, template) for k in range(len(CLASS_NAMES))])
    z_classes = F.normalize(model.encoder_y(classes.to(images.device)).float(), dim=-1)  # 10 x d
    z_images = F.normalize(model.encoder_x(images).float(), dim=-1)  # n x d
    predictions = (z_images @ z_classes.T).argmax(1)
    model.train(was_training)
    return predictions.eq(labels).float().mean().item(), predictions


def confusion_matrix(labels: torch.Tensor, predictions: torch.Tensor) -> torch.Tensor:
    """10 x 10 counts: row = true digit, column = predicted digit."""
    k = len(CLASS_NAMES)
    return torch.bincount(labels.cpu() * k + predictions.cpu(), minlength=k * k).view(k, k)
