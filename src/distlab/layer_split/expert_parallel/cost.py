"""What expert parallelism sends, by formula from the routing; and where the tokens go.

The routing of a step is a P x E matrix of token counts, `kept[s, i]`: tokens of rank s sent to expert i
and kept by the capacity rule. Rank q owns experts q E/P .. (q+1) E/P - 1, so summing a row over an owner's
experts gives the **routing matrix between ranks**, `to_owner[s, q]`: tokens rank s sends to rank q (its
diagonal stays on the rank, never on the wire).

Bytes rank r sends, a token being a row of d values of e bytes:

    dispatch, forward    sum_{q != r} to_owner[r, q]  d e    its tokens that leave for other experts' owners
    combine, forward     sum_{s != r} to_owner[s, r]  d e    the experts' outputs for other ranks' tokens, back
    combine, backward    = dispatch forward                  the gradients of the outputs it got back
    dispatch, backward   = combine forward                   the gradients of the tokens it received
    counts               (P-1) E 8                          every rank's E counts (int64), all-gathered

The backward of an all-to-all is the all-to-all with the counts swapped (`distlab.comm.differentiable`),
so each backward phase moves the rows its forward moved, the other way. Nothing here depends on which
tokens were routed where beyond the counts: the bytes are a function of the routing matrix alone.
"""

from __future__ import annotations

import torch

from distlab.comm.collectives import ring_bytes

COUNT_BYTES = 8  # an int64 count


def routing_matrix(kept: torch.Tensor, world_size: int) -> torch.Tensor:
    """to_owner[s, q]: tokens rank s sends to the experts of rank q (P x P), from kept (P x E)."""
    return kept.view(kept.shape[0], world_size, -1).sum(-1)


def expected_bytes(kept: torch.Tensor, rank: int, row_bytes: int) -> dict[str, int]:
    """Bytes rank `rank` sends in each phase of one forward and backward, by the formula above."""
    world, experts = kept.shape
    to_owner = routing_matrix(kept, world)
    leaving = int(to_owner[rank].sum() - to_owner[rank, rank]) * row_bytes
    returning = int(to_owner[:, rank].sum() - to_owner[rank, rank]) * row_bytes
    return {
        "counts": ring_bytes("all_gather", world * experts, COUNT_BYTES, world),
        "dispatch": leaving,
        "combine": returning,
        "combine backward": leaving,
        "dispatch backward": returning,
    }
