"""What the tests share (CS336's tests/common.py is the model): tiny runners and checks that several
test files need. No test file imports another test file; what two of them need lives here."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable



from distlab.spawn import spawn

ROOT = Path(__file__).resolve().parent.parent
LESSONS = ROOT / "lessons"


def _error_of(rt, fn: Callable[..., Any], args: tuple, kwargs: dict) -> str | None:
    """Run `fn(rt, *args, **kwargs)` on this rank; the ValueError's message, or None if none."""
    try:
        fn(rt, *args, **kwargs)
    except ValueError as err:
        return str(err)
    return None


def errors_on_every_rank(fn: Callable[..., Any], world_size: int, *args: Any, **kwargs: Any) -> list[str | None]:
    """Each rank's ValueError message (None where `fn` returned), in rank order."""
    return spawn(_error_of, world_size, fn, args, kwargs)


def assert_same_error_on_every_rank(fn: Callable[..., Any], world_size: int, *args: Any,
                                    match: str, **kwargs: Any) -> str:
    """Bad input must be one clear error, raised the same way on every rank (so none hangs in a
    collective waiting for a rank that gave up): every rank raises ValueError with one message
    containing `match`. Returns the message."""
    messages = errors_on_every_rank(fn, world_size, *args, **kwargs)
    assert all(m is not None for m in messages), f"some ranks raised nothing: {messages}"
    assert len(set(messages)) == 1, f"ranks disagree: {messages}"
    assert match in messages[0], f"{match!r} not in {messages[0]!r}"
    return messages[0]


class CommHookCounter:
    """A DDP comm hook that counts the all-reduces DDP launches (one per bucket) and then does
    exactly what DDP would: average the bucket over the ranks.

        counter = CommHookCounter(); ddp_model.register_comm_hook(None, counter)
    """

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, state, bucket):
        import torch.distributed as dist

        self.calls += 1
        tensor = bucket.buffer().div_(dist.get_world_size())
        return dist.all_reduce(tensor, async_op=True).get_future().then(lambda fut: fut.value()[0])


def torchrun(lesson: str, nproc: int, *args: str, timeout: float = 300, columns: int | None = None):
    """Run `lessons/<lesson>` under torchrun, output captured; returns the CompletedProcess."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if columns is not None:
        env["COLUMNS"] = str(columns)
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", str(nproc), str(LESSONS / lesson), *args],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


def no_ellipsis(text: str) -> bool:
    """No table cell cut short: rich marks a cut with '\u2026'."""
    return "\u2026" not in text


# ---------------------------------------------------------------------------------------------
# The streamed step (lesson 11, distributed_clip): a small CLIP-like model and its reference
# ---------------------------------------------------------------------------------------------

import math  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

STREAMED_N = 24  # a global batch divisible by P = 1, 2, 3 and 4
DROPOUT_SEED = 100  # rank r's dropout stream starts from torch.manual_seed(DROPOUT_SEED + r)


class Towers(nn.Module):
    """Two small towers (Linear, [BatchNorm], Tanh, Dropout, Linear) with L2-normalised outputs and,
    with `scale_shape`, a learnable logit scale s = exp(logit_scale) returned third (open_clip's way).
    `float32_out` names the towers whose embeddings leave the model in float32 (under autocast)."""

    def __init__(self, scale_shape=None, dropout=0.0, batchnorm=False, dtype=torch.float64,
                 float32_out=(), seed=0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)

        def tower(dim_in):
            layers = [nn.Linear(dim_in, 16, dtype=dtype)] + ([nn.BatchNorm1d(16, dtype=dtype)] if batchnorm else [])
            layers += [nn.Tanh(), nn.Dropout(dropout), nn.Linear(16, 8, dtype=dtype)]
            with torch.no_grad():
                for p in (q for layer in layers for q in layer.parameters()):
                    p.copy_(torch.randn(p.shape, generator=gen, dtype=dtype) * 0.4)
            return nn.Sequential(*layers)

        self.encoder_x, self.encoder_y = tower(12), tower(10)
        self.float32_out = float32_out
        if scale_shape is not None:
            self.logit_scale = nn.Parameter(torch.full(scale_shape, math.log(1 / 0.07), dtype=dtype))

    def forward(self, x, y):
        z_x, z_y = F.normalize(self.encoder_x(x), dim=-1), F.normalize(self.encoder_y(y), dim=-1)
        z_x, z_y = (z.float() if name in self.float32_out else z for z, name in ((z_x, "x"), (z_y, "y")))
        return (z_x, z_y) if not hasattr(self, "logit_scale") else (z_x, z_y, self.logit_scale.exp())


def symmetric_infonce(z_x, z_y, s):
    logits = s * z_x @ z_y.T
    labels = torch.arange(len(z_x))
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2


def split_sizes(c, b):
    """The split the step promises: the fewest micro-batches of at most B rows, sizes within one."""
    parts = -(-c // min(b, c))
    return [c // parts + (k < c % parts) for k in range(parts)]


def full_batch(model, x, y, world, b, tau=None, streams=None):
    """The symmetric InfoNCE of the whole global batch, one forward per micro-batch of each rank
    (rank r's masks drawn from streams[r] when given), the scale s as an ordinary tensor."""
    c, outs = len(x) // world, []
    for r in range(world):
        if streams is not None:
            torch.set_rng_state(streams[r])
        start = r * c
        for size in split_sizes(c, b):
            outs.append(model(x[start:start + size], y[start:start + size]))
            start += size
        if streams is not None:
            streams[r] = torch.get_rng_state()
    z_x, z_y = (torch.cat([o[i] for o in outs]) for i in (0, 1))
    s = outs[0][2] if tau is None else 1 / tau
    return symmetric_infonce(z_x, z_y, s)


def rank_streams(world, seed=DROPOUT_SEED):
    with torch.random.fork_rng():
        return [torch.manual_seed(seed + r).get_state() for r in range(world)]


def local_rows(rt, n=STREAMED_N):
    c = n // rt.world_size
    return slice(rt.rank * c, (rt.rank + 1) * c)
