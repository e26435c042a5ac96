"""Cutting rows 0 ... n-1 into consecutive slices: fixed-size chunks, or balanced parts.

`chunks(n, size)` cuts tiles and GradCache's chunks (the last one shorter); `balanced_chunks(n, most)`
cuts the streamed step's micro-batches: the fewest parts of at most `most` rows, sizes within one
(C = 16, B = 5 gives 4, 4, 4, 4, not 5, 5, 5, 1: a 1-row micro-batch wastes a forward and breaks
BatchNorm). A reference that replays a step's dropout must cut exactly as the step does, so both
import these.
"""

from __future__ import annotations


def chunks(total: int, size: int) -> list[slice]:
    """[0, size), [size, 2 size), ...; the last one shorter when size does not divide total."""
    return [slice(start, min(start + size, total)) for start in range(0, total, size)]


def split_into(total: int, parts: int) -> list[slice]:
    """`parts` consecutive slices of [0, total) whose sizes differ by at most one."""
    small, extra = divmod(total, parts)
    bounds = [0]
    for k in range(parts):
        bounds.append(bounds[-1] + small + (k < extra))
    return [slice(lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:])]


def balanced_chunks(total: int, most: int) -> list[slice]:
    """The fewest consecutive parts of at most `most` rows, whose sizes differ by at most one."""
    return split_into(total, -(-total // most))
