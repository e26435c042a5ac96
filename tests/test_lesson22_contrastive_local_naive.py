"""Lesson 22: local x global with the plain gather. Its gradient is far from the full-batch one and
equal to what the lesson says it computes: each rank's local loss with the other ranks' embeddings
detached, averaged over ranks (computed here in one process, without any of the distributed code).
Training with it follows its own path; training with the fix follows the single process exactly."""

import pytest
import torch
from helpers import assert_flag_refused, assert_lesson_passes_at_80_columns, parse_lesson_args

from distlab.contrastive.reference import DetachedBlocks, full_batch_gradients
from distlab.contrastive.step import first_step_gradients, wrap_ddp
from distlab.contrastive.training import TrainConfig, TrainData, batch_schedule, train_ddp, train_single_process
from distlab.contrastive.variants import LOCAL_PLAIN, LOCAL_SUM
from distlab.processes.spawn import spawn
from distlab.proof.compare import all_ok, compare, compare_whole
from distlab.proof.models import TwoTower, paired_data

N, TAU, SEED = 12, 0.1, 5


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_plain_gather_computes_the_detached_blocks_gradient(world_size):
    per_rank = spawn(first_step_gradients, world_size, (LOCAL_PLAIN,), N, TAU, seed=SEED)
    x, y = paired_data(N, seed=SEED)
    ref_loss, ref_grads = full_batch_gradients(TwoTower(seed=SEED), x, y, 1 / TAU)
    detached_loss, detached_grads = full_batch_gradients(
        TwoTower(seed=SEED), x, y, 1 / TAU, loss_fn=DetachedBlocks(world_size)
    )
    assert detached_loss == pytest.approx(ref_loss, rel=1e-12)  # same loss value, different gradient
    for results in per_rank:
        loss, grads = results[LOCAL_PLAIN.name]
        assert loss == pytest.approx(ref_loss, rel=1e-10, abs=1e-12)  # the forward pass is right
        assert all_ok(compare(detached_grads, grads))  # float64: rtol 1e-10, atol 1e-12
        if world_size == 1:
            assert all_ok(compare(ref_grads, grads))  # nothing to lose with one rank
        else:
            far = compare_whole(ref_grads, grads)
            assert far.max_rel > 0.1 and not far.ok, far  # far from the reference, not a rounding slip


def test_detached_blocks_differs_from_the_reference_for_every_p_above_one():
    """Guard for the test above: the two single-process references are not secretly the same."""
    x, y = paired_data(N, seed=SEED)
    _, ref = full_batch_gradients(TwoTower(seed=SEED), x, y, 1 / TAU)
    for p in (2, 3, 4):
        _, det = full_batch_gradients(TwoTower(seed=SEED), x, y, 1 / TAU, loss_fn=DetachedBlocks(p))
        assert not all_ok(compare(ref, det))


TRAIN, HELD_OUT, STEPS = 48, 24, 6
CONFIG = TrainConfig(tau=TAU, optimizer="adam", lr=0.01, eval_every=3)


def _data():
    return TrainData(
        paired_data(TRAIN, seed=SEED), paired_data(HELD_OUT, seed=SEED + 1), batch_schedule(TRAIN, N, STEPS, SEED)
    )


def _train(rt, variant):
    return train_ddp(rt, wrap_ddp(TwoTower(seed=SEED), rt), variant, _data(), CONFIG)


@pytest.mark.parametrize("variant, exact", [(LOCAL_SUM, True), (LOCAL_PLAIN, False)], ids=["fixed", "plain"])
def test_training_with_the_fix_follows_the_single_process(variant, exact):
    runs = spawn(_train, 3, variant)
    single = train_single_process(TwoTower(seed=SEED), _data(), CONFIG)
    losses = torch.tensor(runs[0].losses, dtype=torch.float64)
    assert all_ok(compare(single.params, runs[0].params)) == exact
    assert torch.allclose(losses, torch.tensor(single.losses, dtype=torch.float64), rtol=1e-10, atol=1e-12) == exact
    assert all(all_ok(compare(runs[0].params, r.params)) for r in runs)  # DDP keeps the replicas equal
    assert single.losses[-1] < single.losses[0]  # it trains, so matching trajectories mean something


LESSON = "contrastive_local_naive"


def test_the_lesson_passes_and_reads_whole_at_80_columns():
    stdout = assert_lesson_passes_at_80_columns(
        LESSON,
        2,
        "--global-batch",
        "24",
        "--steps",
        "4",
        "--train-size",
        "96",
        "--held-out",
        "32",
        "--eval-every",
        "2",
        "--detached-at",
        "1,4",
    )
    # One progress line per run rank 0 shows (its one-process seeds 0 and 2, the three plain runs), no redraws.
    progress_lines = [line for line in stdout.splitlines() if "4/4" in line]
    assert len(progress_lines) == len(set(progress_lines)) == 5, progress_lines
    assert "lower held-out accuracy in" in stdout and "+-" in stdout  # the seeds' comparison and its spread


@pytest.mark.parametrize(
    "args, flag",
    [
        (["--detached-at", "abc"], "--detached-at"),
        (["--detached-at", "8,0"], "--detached-at"),
        (["--detached-at", "7"], "--detached-at"),
        (["--global-batch", "0"], "--global-batch"),
        (["--global-batch", "5000"], "--global-batch"),
        (["--lr", "nan"], "--lr"),
        (["--tau", "0"], "--tau"),
        (["--steps", "-2"], "--steps"),
        (["--optimizer", "lion"], "--optimizer"),
    ],
)
def test_bad_flags_are_refused_before_any_process_group(args, flag):
    assert_flag_refused(LESSON, flag, *args)


def test_detached_at_takes_world_sizes_and_help_shows_the_defaults():
    assert parse_lesson_args(LESSON, "--detached-at", "8,16,8,240")[1].detached_at == (8, 16, 240)
    code, _, out, _ = parse_lesson_args(LESSON, "--help")
    assert code == 0 and "(default: 240)" in out
