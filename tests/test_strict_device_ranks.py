"""Strict device mode on P = 2 ranks, in one spawn: the bug class it exists for is caught, the same code
written right passes, and every lesson's library path runs in strict mode with tiny sizes
(tests/test_strict_device.py tests the mode itself, in one process)."""

from __future__ import annotations

import copy
import os
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import all_ranks_true
from helpers import strict_mode_off as _is_off
from torch.nn.parallel import DistributedDataParallel as DDP

from distlab.processes.spawn import spawn
from distlab.processes.strict import HOST, StrictDeviceError, strict_device

ROOT = Path(__file__).resolve().parent.parent


# --- on P = 2 ranks: the bug class is caught, right code passes, every library path runs ------------


def _flag_made_without_device(rt):
    """How lessons 01-04 and 24 agreed on a flag before `all_ranks_true` took a device."""
    t = torch.tensor([1], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)


def _timing_made_without_device(rt):
    """contrastive/cost.py's slowest-rank reduction of a timing."""
    slowest = torch.tensor([0.25], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)


def _ddp_of_unplaced_towers(rt):
    """Lesson 24's towers: deep copies of a model built on the default device, wrapped in DDP."""
    from distlab.proof.models import TwoTower

    DDP(copy.deepcopy(TwoTower(seed=0).encoder_x))


def _gather_of_a_cpu_copy(rt):
    """A functional (autograd) all-gather of embeddings moved to the CPU first."""
    from distlab.contrastive.gather import gather_library

    gather_library(torch.randn(3, 4, device=rt.device).cpu())


def _inputs_left_on_the_host(rt):
    """Towers on the device, a batch made on the default device: a GPU refuses the first matmul."""
    from distlab.proof.models import TwoTower, paired_data

    ddp = DDP(TwoTower(seed=0).to(rt.device))
    ddp(*paired_data(4, seed=1))


def _flag_on_device(rt):
    assert all_ranks_true(True, rt.device) and not all_ranks_true(rt.rank == 0, rt.device)


def _ddp_of_placed_towers(rt):
    from distlab.proof.models import TwoTower

    ddp = DDP(copy.deepcopy(TwoTower(seed=0).encoder_x).to(rt.device))
    ddp(torch.randn(2, 12, dtype=torch.float64, device=rt.device)).sum().backward()


def _gather_on_device(rt):
    from distlab.contrastive.gather import gather_library

    z = torch.randn(3, 4, device=rt.device, requires_grad=True)
    gathered = gather_library(z)
    assert gathered.shape == (6, 4) and gathered.device == rt.device
    gathered.sum().backward()


BUGS = {  # what strict mode must catch: (case, the collective its message must name)
    "a flag made without device": (_flag_made_without_device, "torch.distributed.all_reduce"),
    "a timing made without device (cost.py)": (_timing_made_without_device, "torch.distributed.all_reduce"),
    "DDP of towers built without device (lesson 24)": (_ddp_of_unplaced_towers, "DistributedDataParallel"),
    "a functional gather of a .cpu() copy": (_gather_of_a_cpu_copy, "_c10d_functional.all_gather_into_tensor"),
    "a batch left on the host (an op, not a collective)": (
        _inputs_left_on_the_host,
        "torch.nn.functional.linear (beside a tensor on cpu:0)",
    ),
}
RIGHT = {
    "all_ranks_true on rt.device": _flag_on_device,
    "DDP of towers moved to rt.device": _ddp_of_placed_towers,
    "a functional gather on rt.device": _gather_on_device,
}

# Library paths, tiny sizes (imports inside: only the ranks need them).


def _pipeline(rt, step_of, **config):
    """Train a few steps of the pipeline track's loop with the step `step_of(rt, cfg)` builds."""
    from distlab.model_split.training import PipelineConfig, train

    cfg = PipelineConfig(**{"widths": (6, 5, 5, 5, 4), "global_batch": 6, "steps": 2, "lr": 0.1, **config})
    train(rt, cfg, step_of(rt, cfg))


def _ours(rt, cfg):
    from distlab.model_split.runner import PipelineStep

    return PipelineStep(rt, cfg)


def _theirs(rt, cfg):
    from distlab.model_split.torch_engine import TorchStep

    return TorchStep(rt, cfg)


def _pipeline_naive(rt):
    from helpers import load_lesson  # lesson 01's send/recv chain lives in the lesson

    _pipeline(rt, load_lesson("model_parallel").ModelParallelStep)


def _pipeline_gpipe_checkpointed(rt):
    _pipeline(rt, _ours, schedule="gpipe", micro_batches=3, checkpoint_segments=2, probe=True)


def _pipeline_one_f_one_b(rt):
    _pipeline(rt, _ours, schedule="1f1b", micro_batches=3, global_batch=5)  # uneven micro-batches


def _pipeline_zero_bubble(rt):
    _pipeline(rt, _ours, schedule="zbv", stages_per_rank=2, micro_batches=3, global_batch=5, probe=True)


def _pipeline_torch(rt):
    _pipeline(rt, _theirs, schedule="1f1b", micro_batches=2, global_batch=4, steps=1)


def _pipeline_torch_zbv(rt):
    _pipeline(rt, _theirs, schedule="zbv", stages_per_rank=2, micro_batches=2, global_batch=4, steps=1)


def _contrastive_every_ddp_method(rt):
    from distlab.contrastive import variants
    from distlab.contrastive.step import first_step_gradients

    every = [
        variants.GLOBAL_PLAIN,
        variants.GLOBAL_TIMES_P,
        variants.GLOBAL_SUM,
        variants.LOCAL_PLAIN,
        variants.LOCAL_SUM,
        variants.LOCAL_LIBRARY,
    ]
    first_step_gradients(rt, every, 8, 0.1)


def _contrastive_ddp_training(rt):
    from distlab.contrastive.training import TrainConfig, TrainData, batch_schedule, train_ddp
    from distlab.contrastive.variants import LOCAL_SUM
    from distlab.proof.models import TwoTower, paired_data

    ddp = DDP(TwoTower(seed=0).to(rt.device))
    train, held_out = (tuple(t.to(rt.device) for t in paired_data(n, seed=s)) for n, s in ((16, 1), (8, 2)))
    data = TrainData(train, held_out, batch_schedule(16, 8, 2, seed=0))
    train_ddp(rt, ddp, LOCAL_SUM, data, TrainConfig(tau=0.1, optimizer="adam", lr=0.01, eval_every=1), "fixed")


def _ddp_rep_clip_loss(rep_x, rep_y, tau):
    """Lesson 24's loss: this rank's rows of the global CLIP loss over the sum-backward gather."""
    from distlab.contrastive.gather import gather_with_grad
    from distlab.contrastive.losses import local_clip_loss

    z_x, z_y = F.normalize(rep_x, dim=-1), F.normalize(rep_y, dim=-1)
    return local_clip_loss(
        z_x, z_y, gather_with_grad(z_x), gather_with_grad(z_y), 1 / tau, offset=dist.get_rank() * len(z_x)
    )


def _grad_cache_under_ddp(rt):
    """As lesson 24 runs it: a Python comm hook counting DDP's all-reduces, memory measured."""
    from distlab.contrastive.grad_cache import GradCache
    from distlab.data_split.data_parallel.ddp import counting
    from distlab.proof.memory import PeakMemory
    from distlab.proof.models import TwoTower, paired_data

    model = TwoTower(dropout=0.1, seed=5).to(rt.device)
    towers = [DDP(model.encoder_x), DDP(model.encoder_y)]
    counters = [counting(tower) for tower in towers]
    rows = slice(4 * rt.rank, 4 * rt.rank + 4)
    x, y = (t[rows].to(rt.device) for t in paired_data(8, seed=6))
    with PeakMemory():  # a dispatch mode: its ops reach strict mode's function mode too
        GradCache(towers, 3, _ddp_rep_clip_loss)(x, y, no_sync_except_last=True, tau=0.1)
    assert [c.calls for c in counters] == [1, 1]


def _streamed_step(rt):
    from distlab.proof.models import TwoTower, paired_data
    from distributed_clip import distributed_train_step

    rows = slice(4 * rt.rank, 4 * rt.rank + 4)
    for normalisers in ("sharded", "replicated"):
        ddp = DDP(TwoTower(dropout=0.1, seed=0).to(rt.device))
        x, y = (t[rows].to(rt.device) for t in paired_data(8, seed=1))
        config = {
            "GLOBAL_BATCH_SIZE": 8,
            "MICRO_BATCH_SIZE": 3,
            "STREAM_CHUNK_SIZE": 3,
            "TAU": 0.1,
            "NORMALISERS": normalisers,
        }
        distributed_train_step(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), x, y, config)


def _contrastive_loss_cost(rt):
    from distlab.contrastive.cost import loss_cost
    from distlab.contrastive.variants import LOCAL_SUM

    z_x, z_y = (F.normalize(torch.randn(4, 3, dtype=torch.float64, device=rt.device), dim=1) for _ in "xy")
    loss_cost(rt, z_x, z_y, 0.1, LOCAL_SUM, repeats=1)


def _contrastive_collective_seconds(rt):
    from distlab.contrastive.cost import collective_seconds

    collective_seconds(rt, 8, 3, torch.float64, repeats=1)


def _verdict_finish(rt):
    from distlab.proof.verdict import Verdict

    verdict = Verdict(rt)
    verdict.check("a claim every rank makes", True)
    verdict.figure("a figure", 1.0)
    assert verdict.finish() == 0


PATHS = {
    "pipeline: naive model parallelism (01)": _pipeline_naive,
    "pipeline: GPipe runner, checkpointed, probed (02)": _pipeline_gpipe_checkpointed,
    "pipeline: 1F1B runner, uneven micro-batches (03)": _pipeline_one_f_one_b,
    "pipeline: ZB-V runner, two stages per rank, B/W split (05)": _pipeline_zero_bubble,
    "pipeline: torch.distributed.pipelining (04)": _pipeline_torch,
    "pipeline: torch.distributed.pipelining, ZBVZeroBubble (05)": _pipeline_torch_zbv,
    "contrastive: every DDP method and gather (10-12)": _contrastive_every_ddp_method,
    "contrastive: DDP training loop (11)": _contrastive_ddp_training,
    "contrastive: GradCache under DDP (13)": _grad_cache_under_ddp,
    "contrastive: streamed step, distributed_clip (14)": _streamed_step,
    "contrastive: a loss's cost (12)": _contrastive_loss_cost,
    "contrastive: collective timings (12)": _contrastive_collective_seconds,
    "verdict.finish": _verdict_finish,
}
KNOWN_BUGS: dict[str, str] = {}  # path -> a device bug strict mode finds there (its fix removes the entry)


def _blame(err: BaseException) -> str:
    """file:line of the innermost frame that is neither torch's nor strict mode's: the call at fault."""
    frames = [
        f
        for f in traceback.extract_tb(err.__traceback__)
        if "site-packages" not in f.filename and not f.filename.endswith("distlab/processes/strict.py")
    ]
    return f"{os.path.relpath(frames[-1].filename, ROOT)}:{frames[-1].lineno}" if frames else "?"


def _run_cases(rt, names):
    """Each case's outcome on this rank, in strict mode: None if it ran, else the error and its line."""
    outcomes = {"strict mode off by default": None if _is_off() and rt.device == HOST else "on"}
    cases = {**{n: f for n, (f, _) in BUGS.items()}, **RIGHT, **PATHS}
    with strict_device(rt) as srt:
        for name in names:
            try:
                cases[name](srt)
                outcomes[name] = None
            except Exception as err:  # noqa: BLE001 - reported per case, the other cases still run
                outcomes[name] = (type(err).__name__, str(err), _blame(err))
    return outcomes


@pytest.fixture(scope="module")
def outcomes():
    return spawn(_run_cases, 2, [*BUGS, *RIGHT, *PATHS], timeout_s=30, limit_s=240)


def test_strict_mode_is_off_unless_asked(outcomes):
    assert [o["strict mode off by default"] for o in outcomes] == [None, None]


@pytest.mark.parametrize("name", BUGS)
def test_strict_mode_catches_the_bug_class(outcomes, name):
    for rank_outcomes in outcomes:
        kind, message, _ = rank_outcomes[name]
        assert kind == "StrictDeviceError", message
        assert BUGS[name][1] in message and " on cpu, but the runtime's device is cpu:0" in message


@pytest.mark.parametrize("name", RIGHT)
def test_the_same_code_on_rt_device_passes(outcomes, name):
    assert [o[name] for o in outcomes] == [None, None]


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=pytest.mark.xfail(raises=StrictDeviceError, strict=True, reason=KNOWN_BUGS[n]))
        if n in KNOWN_BUGS
        else n
        for n in PATHS
    ],
)
def test_every_library_path_runs_in_strict_mode(outcomes, name):
    for rank_outcomes in outcomes:
        if rank_outcomes[name] is not None:
            kind, message, where = rank_outcomes[name]
            if kind == "StrictDeviceError":
                raise StrictDeviceError(f"{message} (at {where})")
            pytest.fail(f"{kind} at {where}: {message}")
