"""Exercise 17: PowerSGD as a DDP communication hook (read lessons/17_powersgd.py first; check your answer with
`pytest --exercises -k 17`; add `--hint-level 1`, 2 or 3 for help).

DDP calls `powersgd_hook(state, bucket)` once per bucket of gradients in every backward, in place of its
all-reduce, and writes into the parameters' .grad the buffer the returned future holds. Write the hook: for
the first START_ITER = 2 steps the plain mean (1/P) sum_r G_r; from then on, with M_r = G_r + Delta_r (this
rank's gradient plus the error it kept), every matrix n x m (a gradient g seen as g.view(g.shape[0], -1)) with
(n + m) ell' x state.min_compression_rate < n m, ell' = min(n, m, state.ell), sent as two thin factors (the
paper's P and Q):

    U = sum_r M_r V          orthonormalise U's columns (Gram-Schmidt)
    V = (1/P) sum_r M_r^T U  the gradient U V^T, V kept for the next step (warm start, re-orthonormalised)

and every other tensor (the vectors) all-reduced whole and averaged; then Delta_r = M_r - (what the buffer now
holds), for the whole bucket, vectors included. V's first value: N(0, 1) entries, drawn with
torch.Generator().manual_seed(int(state.rng.randint(1_000_000_000))) and torch.randn(m, ell', generator=...,
dtype=...), one draw per bucket, the matrices in the bucket's order, then orthonormalised.

What you have, `state` (the lesson's LowRankState): `state.ell`, `state.min_compression_rate`, `state.group`,
`state.step` (completed steps; `state.bucket_done(bucket)` counts them: call it before you return),
`state.errors` and `state.vs` (dicts by `bucket.index()`, yours to fill), `state.rng` (numpy), and
`state.all_reduce(flat, phase)`: dist.all_reduce (a sum) that counts the bytes. `bucket.buffer()` is the flat
gradient buffer, `bucket.gradients()` views of each parameter's gradient in it. Return a
torch.futures.Future whose result is the buffer (`future.set_result(buffer)`).

The judge (P = 3, an MLP 16 -> 24 -> 24 -> 8, ell = 2, 5 SGD steps) checks the parameters against torch's
`powerSGD_hook` (float64, rtol 1e-10) and the bytes your all-reduces send against the ring formula for the
factors and the vectors.
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations, as types, at registration.
import torch
import torch.distributed as dist

START_ITER = 2


def powersgd_hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's all-reduce of one bucket replaced by PowerSGD's: the buffer ends holding, in each matrix's place,
    U V^T (compressed) or the mean (sent whole). Every rank ends with the same buffer."""
    raise NotImplementedError("not written yet: powersgd_hook(state, bucket)")
