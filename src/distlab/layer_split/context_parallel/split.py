"""Which positions of the sequence each rank holds, and how much causal attention work that gives it.

A sequence of seq positions is cut into pieces that the ranks keep for the whole step (their query
rows, and at the start their key/value rows).

- contiguous: P pieces of seq/P; rank r holds piece r.
- zig-zag: 2P pieces of seq/(2P); rank r holds pieces r and 2P-1-r (one early, one late).

Causal attention lets position i see the keys j <= i only. A tile of query piece a against key piece b
(pieces of equal size) is then full (b < a), diagonal (b = a: computed whole, then the upper triangle
masked) or skipped (b > a). Per rank, counting the query-key products computed (a diagonal tile
counts whole, as the kernel computes it):

    contiguous  rank r: r full tiles and 1 diagonal of side seq/P:   (r + 1) (seq/P)^2     unequal
    zig-zag     every rank: 2P - 1 full tiles and 2 diagonals of side seq/(2P):
                                                                   (2P + 1) (seq/(2P))^2  equal

Rank P-1 of the contiguous split does P times the work of rank 0 and the step waits for it; the
zig-zag pairs an early piece (little to see) with a late one (much to see), so every rank does the same.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from distlab.processes.flags import require

SPLITS = ("zigzag", "contiguous")
FULL, DIAGONAL, SKIP = "full", "diagonal", "skip"


def check_seq_len(seq_len: int, world_size: int, split: str) -> None:
    """The split must cut seq into equal pieces: the same ValueError on every rank, before any
    collective, naming the flag."""
    if split not in SPLITS:
        raise ValueError(f"--split: expected one of {SPLITS}, got {split!r}")
    pieces = 2 * world_size if split == "zigzag" else world_size
    what = "2P" if split == "zigzag" else "P"
    require(
        seq_len % pieces == 0,
        "--seq-len",
        f"seq = {seq_len} is not divisible by {what} = {pieces} (the {split} split cuts it into {pieces} equal pieces)",
    )


def pieces_of(rank: int, world_size: int, seq_len: int, split: str) -> list[range]:
    """The positions rank r holds, as ranges of the global sequence, in the order it stores them."""
    if split == "zigzag":
        size = seq_len // (2 * world_size)
        return [range(i * size, (i + 1) * size) for i in (rank, 2 * world_size - 1 - rank)]
    size = seq_len // world_size
    return [range(rank * size, (rank + 1) * size)]


def shard(x: torch.Tensor, rank: int, world_size: int, split: str) -> torch.Tensor:
    """Rank r's rows of x (..., seq, d_h) along the sequence dimension (-2), a contiguous copy."""
    rows = pieces_of(rank, world_size, x.shape[-2], split)
    return torch.cat([x[..., r.start : r.stop, :] for r in rows], dim=-2).contiguous()


def unshard(blocks: list[torch.Tensor], split: str) -> torch.Tensor:
    """The whole sequence back from every rank's block (in rank order): the inverse of `shard`."""
    world_size, local = len(blocks), blocks[0].shape[-2]
    seq_len = world_size * local
    out = blocks[0].new_empty(*blocks[0].shape[:-2], seq_len, blocks[0].shape[-1])
    for rank, block in enumerate(blocks):
        start = 0
        for r in pieces_of(rank, world_size, seq_len, split):
            out[..., r.start : r.stop, :] = block[..., start : start + len(r), :]
            start += len(r)
    return out


def tile_kind(queries: range, keys: range, causal: bool) -> str:
    """full, diagonal (some products masked) or skip (every product masked) for one tile."""
    if not causal or keys[-1] <= queries[0]:
        return FULL
    return SKIP if keys[0] > queries[-1] else DIAGONAL


@dataclass(frozen=True)
class Work:
    """What one rank computes over the whole ring: tiles by kind, and query-key products."""

    full: int
    diagonal: int
    products: int


def count_work(rank: int, world_size: int, seq_len: int, split: str, causal: bool) -> Work:
    """Rank r's tiles and products, from the layout alone (every key piece of every rank meets every
    query piece of rank r once around the ring)."""
    tiles = [
        (q, k)
        for q in pieces_of(rank, world_size, seq_len, split)
        for src in range(world_size)
        for k in pieces_of(src, world_size, seq_len, split)
    ]
    kinds = [tile_kind(q, k, causal) for q, k in tiles]
    products = sum(len(q) * len(k) for (q, k), kind in zip(tiles, kinds) if kind != SKIP)
    return Work(kinds.count(FULL), kinds.count(DIAGONAL), products)


def work_formula(rank: int, world_size: int, seq_len: int, split: str, causal: bool) -> int:
    """Query-key products rank r computes: the closed forms of the module docstring."""
    if not causal:
        return seq_len * seq_len // world_size
    if split == "zigzag":
        return (2 * world_size + 1) * (seq_len // (2 * world_size)) ** 2
    return (rank + 1) * (seq_len // world_size) ** 2


@dataclass(frozen=True)
class Layout:
    """How the sequence is laid out over the ranks, and whether attention is causal."""

    world_size: int
    seq_len: int
    split: str
    causal: bool

    def pieces(self, rank: int) -> list[tuple[slice, range]]:
        """Rank r's pieces: (where it sits in r's block, which global positions it holds)."""
        out, start = [], 0
        for positions in pieces_of(rank, self.world_size, self.seq_len, self.split):
            out.append((slice(start, start + len(positions)), positions))
            start += len(positions)
        return out


def piece_label(rank: int, world_size: int, seq_len: int) -> str:
    """Which of the 2P zig-zag pieces rank r holds, as text: '0,7' for rank 0 of 4."""
    size = seq_len // (2 * world_size)
    return ",".join(str(r.start // size) for r in pieces_of(rank, world_size, seq_len, "zigzag"))
