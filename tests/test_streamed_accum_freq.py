"""open_clip's `--accum-freq` step and `distributed_backward` with B < C, side by side (P = 2, float64).

Both hold only part of a rank's C pairs' activations at a time. open_clip_train caches every batch's
features in a no-grad pass, then per accumulated batch runs one forward with grad and the backward of
the whole loss (tests/open_clip_like.py re-implements it). Against the single-process reference on
the whole global batch:

- without dropout its encoder gradients are exact, and its logit scale's gradient is accum_freq times
  the true one (each of the k backwards carries the whole dL/ds);
- with dropout the recompute draws new masks, so each backward mixes batch j's new features with the
  others' cached ones: the gradient is neither the loss's under the cached masks nor under the
  recompute's;
- `distributed_backward` (B < C: a no-grad pass, then a recompute under the saved random state) is
  exact in all three.

`figures()` returns the numbers the README quotes.
"""

import torch
from open_clip_like import CLIP, accum_freq_backward, grads_by_name, image_text_data, reference
from streamed_helpers import DROPOUT_SEED, local_rows, rank_streams
from torch.nn.parallel import DistributedDataParallel as DDP

from distlab.processes.spawn import spawn
from distlab.proof.compare import compare_whole
from distributed_clip import distributed_backward

N, ACCUM_FREQ = 24, 3  # P = 2: C = 12 pairs per rank, in 3 batches of B = 4
B = N // 2 // ACCUM_FREQ
DROPOUT = 0.3
SCALE = "logit_scale"


def both_steps(rt, dropout):
    """(open_clip's gradients, distributed_backward's gradients) on this rank, from the same seeds."""
    images, texts = image_text_data(N)
    rows = local_rows(rt, N)
    x, y = images[rows], texts[rows]
    model = CLIP(output_dict=True, dropout=dropout)
    torch.manual_seed(DROPOUT_SEED + rt.rank)
    batches = [(x[k : k + B], y[k : k + B]) for k in range(0, len(x), B)]
    accum_freq_backward(DDP(model), batches)
    open_clip = grads_by_name(model)
    model = CLIP(output_dict=True, dropout=dropout)
    torch.manual_seed(DROPOUT_SEED + rt.rank)
    config = {"GLOBAL_BATCH_SIZE": N, "MICRO_BATCH_SIZE": B, "STREAM_CHUNK_SIZE": 5}
    distributed_backward(DDP(model), x, y, config)
    return open_clip, grads_by_name(model)


def run_all(rt):
    return {dropout: both_steps(rt, dropout) for dropout in (0.0, DROPOUT)}


def split(grads):
    """(the encoders' gradients, the logit scale's)."""
    return {k: v for k, v in grads.items() if k != SCALE}, grads[SCALE]


def figures() -> dict[str, float]:
    """The comparison's numbers: relative errors (the largest over the tensors; open_clip's with
    dropout over the encoders alone, so that its scale's known factor does not stand in for them)
    and the scale's ratio."""
    results = spawn(run_all, 2, timeout_s=60)
    images, texts = image_text_data(N)
    exact = reference(CLIP(output_dict=True), images, texts, 2, B)[1]
    streams = rank_streams(2)  # the masks each rank's first pass draws, then those its recompute draws
    cached = reference(CLIP(output_dict=True, dropout=DROPOUT), images, texts, 2, B, streams)[1]
    recomputed = reference(CLIP(output_dict=True, dropout=DROPOUT), images, texts, 2, B, streams)[1]
    (oc, ours), (oc_drop, ours_drop) = results[0][0.0], results[0][DROPOUT]
    out = {
        "open_clip encoders": compare_whole(split(exact)[0], split(oc)[0]).max_rel,
        "open_clip scale ratio": (split(oc)[1] / split(exact)[1]).item(),
        "ours encoders": compare_whole(split(exact)[0], split(ours)[0]).max_rel,
        "ours scale": compare_whole({SCALE: exact[SCALE]}, {SCALE: ours[SCALE]}).max_rel,
        "open_clip dropout vs cached masks": compare_whole(split(cached)[0], split(oc_drop)[0]).max_rel,
        "open_clip dropout vs recompute masks": compare_whole(split(recomputed)[0], split(oc_drop)[0]).max_rel,
        "ours dropout vs cached masks": compare_whole(cached, ours_drop).max_rel,
    }
    for label, ref in (("cached", cached), ("recompute", recomputed)):
        out[f"open_clip dropout cosine to {label} masks"] = compare_whole(split(ref)[0], split(oc_drop)[0]).cosine
    out["ranks agree"] = float(
        all(
            torch.equal(results[0][d][i][k], r[d][i][k])
            for r in results
            for d in (0.0, DROPOUT)
            for i in (0, 1)
            for k in results[0][d][i]
        )
    )
    return out


def test_open_clips_accum_freq_against_the_streamed_step():
    got = figures()
    assert got["ranks agree"] == 1.0, got
    # open_clip without dropout: the encoders exact, the logit scale accum_freq times too large.
    assert got["open_clip encoders"] < 1e-10, got
    assert abs(got["open_clip scale ratio"] - ACCUM_FREQ) < 1e-10, got
    # With dropout: the gradient of neither the cached masks' loss nor the recompute's.
    assert got["open_clip dropout vs cached masks"] > 1e-3, got
    assert got["open_clip dropout vs recompute masks"] > 1e-3, got
    # distributed_backward with B < C: exact in all three.
    assert got["ours encoders"] < 1e-10 and got["ours scale"] < 1e-10, got
    assert got["ours dropout vs cached masks"] < 1e-10, got
