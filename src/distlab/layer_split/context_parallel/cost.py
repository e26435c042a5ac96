"""What ring attention costs each rank, by formula: bytes sent and memory held; and the measured side
gathered from every rank.

Units: a block is one rank's k (or v, dk, dv), h x seq/P x d_h values; a tile is the scores of a
zig-zag piece against a piece, h x (seq/2P)^2; a row vector is one statistic per query row,
h x seq/P.

Bytes sent per rank. Forward: k and v move P-1 times, 2(P-1) blocks. Backward: k and v move P-1
times again and dk, dv P times (the last move takes them home), 2(P-1) + 2P = 4P-2 blocks; nothing
at P = 1.

Memory per rank (upper bounds; what `distlab.proof.memory.PeakMemory` measures inside the ring). k/v pairs
received and held at once: one at P = 2 (the rank's own pair is an input), two from P = 3 (the one
in use and the one arriving). Forward: those, the output o (1 block), one tile's o-update (1/2
block), the scores twice, 8 row vectors (m, l and their updates). Backward: those, two dk/dv pairs
(4 blocks), dq (1), one tile's dq, dk, dv (3/2), three tiles (omega, dout v^T, dA), 4 row vectors.
In blocks nothing here grows with P (from P = 3, when a second pair is in flight); in bytes a block is
h (seq/P) d_h e, so at a fixed seq the bounds shrink as 1/P from P = 3 (the tiles as 1/P^2), while the
whole sequence's k and v, 2P blocks, stay 2 h seq d_h e.
At P = 2 a rank holds its own pair and the one received: the whole sequence's k and v. The bounds fall
below them only from some P (`beats_whole`): forward, where 2P blocks exceed 4 + 3/2 blocks plus its tiles
and rows; backward, where they exceed 4 + 13/2.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Sizes:
    heads: int
    seq_len: int
    head_dim: int
    world_size: int
    itemsize: int

    @property
    def block(self) -> int:
        return self.heads * (self.seq_len // self.world_size) * self.head_dim * self.itemsize

    @property
    def tile(self) -> int:
        return self.heads * (self.seq_len // (2 * self.world_size)) ** 2 * self.itemsize

    @property
    def row(self) -> int:
        return self.heads * (self.seq_len // self.world_size) * self.itemsize

    def expected_bytes(self) -> tuple[int, int]:
        """(forward, backward) bytes each rank sends, by the formula above."""
        world = self.world_size
        return 2 * (world - 1) * self.block, ((4 * world - 2) * self.block if world > 1 else 0)

    def memory_bound(self) -> tuple[int, int]:
        """(forward, backward) upper bounds on the bytes the ring allocates per rank."""
        kv = 2 * min(self.world_size - 1, 2) * self.block
        return (
            kv + 3 * self.block // 2 + 2 * self.tile + 8 * self.row,
            kv + 13 * self.block // 2 + 3 * self.tile + 4 * self.row,
        )

    def whole_kv(self) -> int:
        """The whole sequence's k and v: 2P blocks, the same bytes at every P."""
        return 2 * self.world_size * self.block

    def at(self, world_size: int) -> Sizes:
        return replace(self, world_size=world_size)


def beats_whole(sizes: Sizes, worlds: list[int]) -> tuple[int | None, int | None]:
    """The smallest P of `worlds` from which the (forward, backward) bound stays below the whole k and v."""
    below = [[s.memory_bound()[i] < s.whole_kv() for s in map(sizes.at, worlds)] for i in (0, 1)]
    return tuple(next((p for k, p in enumerate(worlds) if all(ok[k:])), None) for ok in below)
