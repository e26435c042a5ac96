"""What the tests share (CS336's tests/common.py is the model): tiny runners and checks that several
test files need. No test file imports another test file; what two of them need lives here (what the
streamed step's tests share, in streamed_helpers.py)."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from distlab.processes.spawn import spawn

ROOT = Path(__file__).resolve().parent.parent
LESSONS = ROOT / "lessons"


def _nbhelpers():
    """lessons/notebooks/nbhelpers.py, the one place that finds a lesson by its slug, loads it, and runs it under
    torchrun: the notebooks' helpers, which the tests share rather than write again."""
    if "nbhelpers" not in sys.modules:
        spec = importlib.util.spec_from_file_location("nbhelpers", LESSONS / "notebooks" / "nbhelpers.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["nbhelpers"] = module
        spec.loader.exec_module(module)
    return sys.modules["nbhelpers"]


lesson_path, load_lesson, torchrun = _nbhelpers().lesson_path, _nbhelpers().load_lesson, _nbhelpers().torchrun


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


def assert_same_error_on_every_rank(
    fn: Callable[..., Any], world_size: int, *args: Any, match: str, **kwargs: Any
) -> str:
    """Bad input must be one clear error, raised the same way on every rank (so none hangs in a
    collective waiting for a rank that gave up): every rank raises ValueError with one message
    containing `match`. Returns the message."""
    messages = errors_on_every_rank(fn, world_size, *args, **kwargs)
    assert all(m is not None for m in messages), f"some ranks raised nothing: {messages}"
    assert len(set(messages)) == 1, f"ranks disagree: {messages}"
    assert match in messages[0], f"{match!r} not in {messages[0]!r}"
    return messages[0]


def all_ranks_true(flag: bool, device: torch.device) -> bool:
    """True on every rank iff `flag` is true on every rank: one all_reduce(MIN) on `device` (the
    right way to agree on a flag; tests/test_strict_device.py's example of code strict mode passes)."""
    import torch.distributed as dist

    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def strict_mode_off() -> bool:
    """No strict device mode is on in this process (`distlab.processes.strict`): nothing patched, no mode pushed."""
    import torch.distributed as dist
    from torch.overrides import _get_current_function_mode_stack

    return not hasattr(dist.all_reduce, "strict_device") and not _get_current_function_mode_stack()


def no_ellipsis(text: str) -> bool:
    """No table cell cut short: rich marks a cut with '\u2026'."""
    return "\u2026" not in text


# -- contrastive lessons 21-23 ------------------------------------------------------------------


GATHER_ROWS, GATHER_COLS = 2, 3


def gather_block(rank: int):
    """Rank r's block for a gather test: distinct values on every rank."""
    return torch.arange(GATHER_ROWS * GATHER_COLS, dtype=torch.float64).reshape(GATHER_ROWS, GATHER_COLS) + 100 * rank


def gather_weights(rank: int, world_size: int):
    """Rank r's loss is sum(W_r * gathered): its gradient with respect to the gathered tensor is W_r."""
    gen = torch.Generator().manual_seed(rank)
    return torch.randn(world_size * GATHER_ROWS, GATHER_COLS, generator=gen, dtype=torch.float64)


def gather_forward_and_backward(rt, gather: Callable[[Any], Any]):
    """(gathered tensor, gradient at this rank's block) when every rank back-propagates its own
    sum(W_r * gather(block_r))."""
    local = gather_block(rt.rank).requires_grad_()
    gathered = gather(local)
    (gathered * gather_weights(rt.rank, rt.world_size)).sum().backward()
    return gathered.detach().clone(), local.grad.clone()


def assert_gather_result(rank: int, world_size: int, gathered, grad, sums_over_ranks: bool) -> None:
    """Forward: the blocks in rank order. Backward: this rank's rows of sum_s W_s (a gather whose
    backward sums over ranks) or of its own W_r (the plain gather), and not the other one."""
    everything = torch.cat([gather_block(r) for r in range(world_size)])
    summed = sum(gather_weights(s, world_size) for s in range(world_size))
    own = gather_weights(rank, world_size)
    rows = slice(rank * GATHER_ROWS, (rank + 1) * GATHER_ROWS)
    assert torch.equal(gathered, everything)
    expected, other = (summed, own) if sums_over_ranks else (own, summed)
    assert torch.allclose(grad, expected[rows], rtol=1e-12, atol=1e-12)
    assert not torch.allclose(grad, other[rows])


def value_error(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> str | None:
    """The message of the ValueError `fn(*args, **kwargs)` raises, or None if it returns (for
    checks that run several bad inputs in one process group, each raised before any collective)."""
    try:
        fn(*args, **kwargs)
    except ValueError as err:
        return str(err)
    return None


def parse_lesson_args(lesson: str, *args: str) -> tuple[int | None, Any, str, str]:
    """A lesson's `parse_args()` on `args`, in this process (no torchrun, no process group):
    (exit code or None, the parsed namespace or None, what it wrote to stdout, to stderr)."""
    import contextlib
    import io

    out, err, argv = io.StringIO(), io.StringIO(), sys.argv
    sys.argv = [lesson_path(lesson).name, *args]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            return None, load_lesson(lesson).parse_args(), out.getvalue(), err.getvalue()
    except SystemExit as exit_:
        return exit_.code, None, out.getvalue(), err.getvalue()
    finally:
        sys.argv = argv


def assert_flag_refused(lesson: str, flag: str, *args: str) -> None:
    """Bad flags: exit 2 with one line that names `flag`, before any process group exists."""
    code, _, _, err = parse_lesson_args(lesson, *args)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and f"argument {flag}:" in lines[0], (code, lines)


def assert_lesson_passes_at_80_columns(lesson: str, nproc: int, *args: str) -> str:
    """The lesson under torchrun at 80 columns: exit 0, every claim held, no line wider than 80 and
    no table cell cut short. Returns what it printed."""
    run = torchrun(lesson, nproc, *args, columns=80)
    assert run.returncode == 0, run.stdout + run.stderr[-2000:]
    assert "PASS: every claim holds" in run.stdout and no_ellipsis(run.stdout), run.stdout
    assert max(len(line) for line in run.stdout.splitlines()) <= 80, run.stdout
    return run.stdout


# -- pipeline lessons 01-05 --------------------------------------------------------------------


def merged(runs, field: str) -> dict:
    """One rank-merged dict of a per-rank field (`first_grads`, `params`) of pipeline runs."""
    return {name: t for run in runs for name, t in getattr(run, field).items()}


def equals_reference(runs, ref) -> bool:
    """Every rank's gradients (step 1), parameters (last step) and the losses equal `ref`'s, at the
    dtype's stated tolerance (float64: rtol 1e-10, atol 1e-12)."""
    import torch

    from distlab.proof.compare import all_ok, compare

    losses = len(runs[0].losses) == len(ref.losses) and torch.allclose(
        torch.tensor(runs[0].losses), torch.tensor(ref.losses), rtol=1e-10, atol=1e-12
    )
    return (
        all_ok(compare(ref.first_grads, merged(runs, "first_grads")))
        and all_ok(compare(ref.params, merged(runs, "params")))
        and losses
    )


def train_each(rt, cfgs, make_step=None):
    """One process group, several pipeline runs (spawning once per configuration costs more than
    the training): per config its `Run`, or the ValueError's message, as this rank saw it.
    `make_step(rt, cfg)` builds the step; by default our runner executing `cfg.schedule`."""
    from distlab.model_split.runner import PipelineStep
    from distlab.model_split.training import train

    out = []
    for cfg in cfgs:
        try:
            out.append(train(rt, cfg, (make_step or PipelineStep)(rt, cfg)))
        except ValueError as err:
            out.append(str(err))
    return out


def torch_step(rt, cfg):
    """PyTorch's engine as a `make_step` for `train_each` (importable by the spawned ranks)."""
    from distlab.model_split.torch_engine import TorchStep

    return TorchStep(rt, cfg)


def per_config(per_rank: list[list]) -> list[list]:
    """spawn's per-rank lists of per-config results, as per-config lists of per-rank results."""
    return [list(ranks) for ranks in zip(*per_rank)]
