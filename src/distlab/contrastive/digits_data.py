"""Lesson 27's data on each rank: the digits split, the tokenised captions, and which rows each rank
trains on at each step (the model and the pieces themselves are in digits.py).

Step k's global batch is pairs k N ... k N + N - 1 of the epoch's permutation (seeded by seed and
epoch), and rank r holds its r-th slice of C = N / P: the same global batches at every P, so P = 1, 2,
4 run the same training, and a resumed run needs only the step to find its place.
"""

from __future__ import annotations

import itertools

import torch

from distlab.contrastive.digits import Tokenizer, caption_table, draw_captions, load_split, zero_shot


class Digits:
    """The split, the tokenised captions, and which rows each rank trains on at each step."""

    def __init__(self, rt, global_batch: int, test_fraction: float, seed: int):
        self.split = load_split(test_fraction, seed)
        self.tokenizer = Tokenizer.for_digits()
        self.table = caption_table(self.tokenizer)  # 10 digits x templates x words
        self.rt, self.seed, self.local = rt, seed, global_batch // rt.world_size
        self.labels = self.split.train_labels
        self._drawn: tuple[int, torch.Tensor] | None = None  # (epoch, every image's caption ids)

    def rows(self, epoch: int, rank: int) -> list[torch.Tensor]:
        """Rank `rank`'s C training rows for each step of `epoch`. Step k's global batch is pairs
        k N ... k N + N - 1 of the epoch's permutation, and rank r holds its r-th slice of C: the same
        global batches at every P, so P = 1, 2, 4 run the same training (a DistributedSampler deals
        rows round-robin, so its global batches change with P). Every rank can rebuild every rank's
        rows, so the reference needs no communication."""
        order = torch.randperm(len(self.labels), generator=torch.Generator().manual_seed(self.seed * 1_000 + epoch))
        n = self.local * self.rt.world_size
        return [order[k * n + rank * self.local :][: self.local] for k in range(len(order) // n)]

    def captions(self, epoch: int) -> torch.Tensor:
        """Every training image's caption ids in `epoch` (a template drawn per image from seed and epoch),
        drawn once per epoch, not once per step."""
        if self._drawn is None or self._drawn[0] != epoch:
            self._drawn = (epoch, draw_captions(self.labels, self.table, self.seed * 100_003 + epoch))
        return self._drawn[1]

    def batch(self, epoch: int, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.split.train_images[rows].to(self.rt.device), self.captions(epoch)[rows].to(self.rt.device)

    def batches(self, first: int = 0):
        """This rank's (images, caption ids) for every step from step `first` (0-based) on, epoch after
        epoch: the order is a function of (seed, epoch), so a resumed run needs only the step."""
        per_epoch = len(self.labels) // (self.local * self.rt.world_size)
        for epoch in itertools.count(first // per_epoch):
            for rows in self.rows(epoch, self.rt.rank)[max(0, first - epoch * per_epoch) :]:
                yield self.batch(epoch, rows)

    def zero_shot(self, model) -> tuple[float, torch.Tensor]:
        images, labels = self.split.test_images.to(self.rt.device), self.split.test_labels.to(self.rt.device)
        return zero_shot(model, images, labels, self.tokenizer)
