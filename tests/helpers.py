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



# --- pipeline track (lessons 01-05) -----------------------------------------------------------

def load_lesson(name: str):
    """A lesson file as a module (its name starts with a digit, so `import` cannot load it); the
    lesson's own mechanism is what its test checks. Cached, so spawned ranks load it once."""
    import importlib.util

    module_name = "lesson_" + name
    if module_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(module_name, LESSONS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
    return sys.modules[module_name]


def merged(runs, field: str) -> dict:
    """One rank-merged dict of a per-rank field (`first_grads`, `params`) of pipeline runs."""
    return {name: t for run in runs for name, t in getattr(run, field).items()}


def equals_reference(runs, ref) -> bool:
    """Every rank's gradients (step 1), parameters (last step) and the losses equal `ref`'s, at the
    dtype's stated tolerance (float64: rtol 1e-10, atol 1e-12)."""
    import torch

    from distlab.compare import all_ok, compare

    losses = len(runs[0].losses) == len(ref.losses) and torch.allclose(
        torch.tensor(runs[0].losses), torch.tensor(ref.losses), rtol=1e-10, atol=1e-12)
    return (all_ok(compare(ref.first_grads, merged(runs, "first_grads")))
            and all_ok(compare(ref.params, merged(runs, "params"))) and losses)


def train_each(rt, cfgs, make_step=None):
    """One process group, several pipeline runs (spawning once per configuration costs more than
    the training): per config its `Run`, or the ValueError's message, as this rank saw it.
    `make_step(rt, cfg)` builds the step; by default our runner executing `cfg.schedule`."""
    from distlab.pipeline.runner import PipelineStep
    from distlab.pipeline.training import train

    out = []
    for cfg in cfgs:
        try:
            out.append(train(rt, cfg, (make_step or PipelineStep)(rt, cfg)))
        except ValueError as err:
            out.append(str(err))
    return out


def torch_step(rt, cfg):
    """PyTorch's engine as a `make_step` for `train_each` (importable by the spawned ranks)."""
    from distlab.pipeline.torch_engine import TorchStep

    return TorchStep(rt, cfg)


def per_config(per_rank: list[list]) -> list[list]:
    """spawn's per-rank lists of per-config results, as per-config lists of per-rank results."""
    return [list(ranks) for ranks in zip(*per_rank)]
