"""Exercise 15: an FP8 all-gather of sharded weights (read lessons/15_mxfp8_sharding.py first; check your answer
with `pytest --exercises -k 15`; add `--hint-level 1`, 2 or 3 for help).

A weight of Psi elements is sharded ZeRO-3 style over the P ranks of `group`: flattened, padded with zeros to
P Psi_P (Psi_P = ceil(Psi / P)), rank r holding elements r Psi_P .. (r+1) Psi_P - 1 (`shard`, float32). Write
`fp8_all_gather`: return every rank the whole padded weight in the 8-bit format `fmt`, and the scale rho, such
that it equals, bit for bit, what one process would get casting the whole weight with lesson 14's tensorwise
cast:

    amax = max |W| over the whole weight,   rho = max_f / amax (float64, then float32; amax at least 1e-12),
    W_q  = cast_fmt(clamp(W rho, -max_f, max_f))

and so that the shards travel in 8 bits: each rank may send (P-1) Psi_P bytes of weight plus a few bytes per
peer to agree on the scale, half of what a bf16 gather sends. (torch's gloo backend cannot all-gather a float8
tensor; a tensor's bytes can be viewed as another 1-byte dtype.)

The judge (P = 3, a 7 x 9 weight whose largest values lie on one rank's shard) compares your result on every
rank with one process's cast, bit for bit, and counts the bytes your collectives send.
"""

from __future__ import annotations

import torch


def fp8_all_gather(shard: torch.Tensor, fmt: torch.dtype, group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(the whole flat weight in fmt, padded to P Psi_P; rho): amax agreed first, so every rank casts with
    the global scale; then the 8-bit shards all-gathered, as bytes (gloo has no float8 all-gather)."""
    raise NotImplementedError("not written yet: fp8_all_gather(shard, fmt, group)")
