"""How CLIP is optimised: AdamW with decay on the weight matrices only, and a warm-up + cosine schedule.

open_clip's recipe (`open_clip_train/main.py`, `scheduler.py`): parameters with fewer than two
dimensions (biases, LayerNorm gains, embeddings' scalars, the logit scale) get no weight decay,
since shrinking them towards 0 has no regularising meaning (a logit scale pulled to 0 is tau = 1);
the learning rate rises linearly over the warm-up steps, then follows half a cosine down to 0:

    lr(t) = lr * (t + 1) / W                                      t < W
    lr(t) = lr * (1 + cos(pi * (t - W) / (T - W))) / 2            W <= t < T
"""

from __future__ import annotations

import math
from collections.abc import Callable

from torch import nn


def decay_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two AdamW parameter groups: matrices (and conv kernels) with `weight_decay`, the rest without."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]


def warmup_cosine(warmup_steps: int, total_steps: int) -> Callable[[int], float]:
    """The learning-rate factor at step t (for `torch.optim.lr_scheduler.LambdaLR`)."""
    if not 0 <= warmup_steps < total_steps:
        raise ValueError(f"need 0 <= warm-up steps < total steps, got {warmup_steps} and {total_steps}")

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / (total_steps - warmup_steps))
        return 0.5 * (1 + math.cos(math.pi * progress))

    return factor
