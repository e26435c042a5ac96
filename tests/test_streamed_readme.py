"""docs/distributed_clip.md's "Using distributed_clip in your training" loop runs as printed: the first Python block of
that section, executed on every rank of a P = 2 `spawn`, trains a TinyCLIP under bf16 autocast with a
GradScaler, clipping and accumulation; the loss goes down, the scale learns, every rank agrees, and the loop's
last line, release_process_group(), leaves no process group behind."""

import math
import re

import torch
import torch.distributed as dist
from helpers import ROOT

from distlab.processes.spawn import spawn
from distlab.proof.models import paired_data

PAGE = ROOT / "docs" / "distributed_clip.md"  # the README links it as "Using distributed_clip"
SECTION = "# Using distributed_clip in your training"


def readme_snippet() -> str:
    text = PAGE.read_text()
    section = text[text.index(SECTION) :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def run_snippet(rt, code, n, steps):
    namespace = {"__name__": "readme_snippet"}
    exec(compile(code, str(PAGE), "exec"), namespace)  # noqa: S102 - the page's own code
    torch.manual_seed(0)
    model = namespace["TinyCLIP"]()
    c = n // rt.world_size

    def batches():  # this rank's share of a new global batch each time, as a DistributedSampler gives
        for seed in range(10**6):
            x, y = paired_data(n, seed=seed, dtype=torch.float32)
            yield x[rt.rank * c : (rt.rank + 1) * c], y[rt.rank * c : (rt.rank + 1) * c]

    made = []
    adamw = torch.optim.AdamW
    torch.optim.AdamW = lambda *args, **kwargs: made.append(adamw(*args, **kwargs)) or made[-1]  # this rank only
    try:
        losses = namespace["train"](model, batches(), n, c // 2, steps)
    finally:
        torch.optim.AdamW = adamw
    decay_of_scale = [
        g["weight_decay"] for g in made[0].param_groups if any(p is model.logit_scale for p in g["params"])
    ]
    return losses, model.logit_scale.item(), decay_of_scale, not dist.is_initialized()


def test_the_readme_loop_runs_and_trains():
    code = readme_snippet()
    assert "distributed_backward(model, x, y, config, grad_scaler=scaler)" in code
    results = spawn(run_snippet, 2, code, 64, 12, timeout_s=120)
    (losses, scale, decay, released), (losses_1, scale_1, _, released_1) = results
    assert released and released_1  # the loop's last line, release_process_group(), ended the group
    assert losses == losses_1 and scale == scale_1  # every rank holds the global loss and the same model
    assert decay == [0.0]  # as open_clip: weight decay would pull the learned scale towards s = 1
    assert len(losses) == 24 and all(math.isfinite(v) for v in losses)
    assert sum(losses[-4:]) < sum(losses[:4]), losses  # it learns (B = C / 2: the recompute regime)
    assert scale != math.log(1 / 0.07)
