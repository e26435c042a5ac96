"""Ulysses (lesson 11): the rule it needs, and what it sends beside ring attention, by formula.

Units as in `cost`: a block is one rank's q (or k, v, out, and their gradients) under the sequence split,
h x seq/P x d_h values of e bytes. Ulysses' all-to-all turns a block into h/P heads x seq positions, the
same number of values, of which the rank keeps 1/P (its own positions of its own heads) and sends (P-1)/P,
one part to each other rank.

Bytes each rank sends:

    Ulysses, forward     q, k, v to head split, out back:       4 (P-1)/P blocks
    Ulysses, backward    dout to head split, dq, dk, dv back:   4 (P-1)/P blocks
    ring, forward        k, v around the ring, P-1 moves:       2 (P-1) blocks
    ring, backward       k, v again; dk, dv home (P moves):     4P - 2 blocks (0 at P = 1)

At P = 2 the two forwards send the same 2 blocks; from P = 3 Ulysses sends less, and at a fixed seq its
bytes per rank fall as the block does (4 (P-1)/P^2 of h seq d_h e), where ring attention's stay near
2 h seq d_h e (forward) however many ranks share the sequence. Ulysses' limit is the heads: a rank computes
whole heads, so P must divide h (and, with grouped-query attention, the key/value heads).
"""

from __future__ import annotations

from distlab.layer_split.context_parallel.cost import Sizes
from distlab.processes.flags import require


def check_split(heads: int, seq_len: int, world_size: int) -> None:
    """P must divide h (whole heads per rank) and seq (equal sequence blocks): the same ValueError on every
    rank, before any collective, naming the flag."""
    require(
        heads % world_size == 0,
        "--heads",
        f"h = {heads} is not divisible by P = {world_size}: Ulysses gives every rank h / P whole heads",
    )
    require(
        seq_len % world_size == 0,
        "--seq-len",
        f"seq = {seq_len} is not divisible by P = {world_size} (the sequence is cut into P equal blocks)",
    )


def expected_bytes(sizes: Sizes) -> tuple[int, int]:
    """(forward, backward) bytes each rank sends in Ulysses: 4 (P-1)/P blocks each way."""
    p = sizes.world_size
    one = (p - 1) * (sizes.block // p)  # what one all-to-all of a block sends: every part but its own
    return 4 * one, 4 * one


def bytes_beside_ring(heads: int, seq_len: int, head_dim: int, itemsize: int, worlds: list[int]) -> list[dict]:
    """Per P (each must divide h and seq): the bytes a rank sends, Ulysses' and ring attention's, forward
    and backward, on the same shapes."""
    rows = []
    for p in worlds:
        sizes = Sizes(heads, seq_len, head_dim, p, itemsize)
        (uf, ub), (rf, rb) = expected_bytes(sizes), sizes.expected_bytes()
        rows.append({"P": p, "block": sizes.block, "ulysses": (uf, ub), "ring": (rf, rb)})
    return rows
