"""Exercise 16: one step of CLIP training with the streamed step (read lessons/16_train_clip.py first;
check your answer with `pytest --exercises -k 16`).

Write `clip_step`: the caller-owned step of any CLIP training loop, with `distributed_backward` in the
place of `loss.backward()`:

    zero the gradients;
    L = distributed_backward(ddp, images, captions, config)    # adds the exact dL/dtheta of the GLOBAL
                                                                 # batch into .grad (s learned: no TAU)
    clip the global gradient norm at clip_norm (the trainable parameters only);
    optimizer.step();
    clamp the logit scale into [1, 100] (s = exp(logit_scale); the model's clamp_logit_scale_());
    return L.

Under bf16 (`bf16=True`) the embedding runs in `torch.autocast(device_type, torch.bfloat16)`; the step's
loss machinery stays in float32 by itself.

Hints:
- `from distributed_clip import distributed_backward`;
- `torch.nn.utils.clip_grad_norm_(params, clip_norm)` with params = those that require grad;
- the model inside DDP is `ddp.module`.
"""

from __future__ import annotations

import torch  # noqa: F401  (you will need it)


def clip_step(ddp, optimizer, images, captions, config: dict, clip_norm: float, bf16: bool = False) -> float:
    """One step of the caller-owned loop: the exact global gradient into .grad, clipped, applied."""
    raise NotImplementedError(
        "not written yet: clip_step(...), zero_grad, distributed_backward, "
        "clip_grad_norm_, optimizer.step, clamp the logit scale"
    )
