"""Exercise 27: one step of CLIP training with the streamed step (read lessons/27_train_clip.py first;
check your answer with `pytest --exercises -k 27`; add `--hint-level 1`, 2 or 3 for help).

Write `clip_step`: the caller-owned step of a CLIP training loop, with `distributed_backward(ddp, images,
captions, config)` in the place of `loss.backward()`: it adds the exact dL/dtheta of the GLOBAL batch into
.grad (as a backward does: added to what is there) and returns L; the model learns its own scale s.

The step must do what open_clip's does, in its order: start from no gradient, back-propagate, bound the
global gradient norm of the trainable parameters at clip_norm, apply the optimizer, and keep the logit
scale s = exp(logit_scale) within [1, 100] (the model knows its bound). Return L.

Under bf16 (`bf16=True`) the embedding runs under bfloat16 autocast on the images' device; the step's loss
machinery stays in float32 by itself.

The judge runs two steps on 2 ranks and compares each step's loss and every parameter's update, the
logit scale's included, with a deep copy stepped in one process on the whole batch (float64).
"""

from __future__ import annotations

import torch  # noqa: F401  (you will need it)


def clip_step(ddp, optimizer, images, captions, config: dict, clip_norm: float, bf16: bool = False) -> float:
    """One step of the caller-owned loop: the exact global gradient into .grad, clipped, applied."""
    raise NotImplementedError("not written yet: clip_step(ddp, optimizer, images, captions, config, clip_norm, bf16)")
