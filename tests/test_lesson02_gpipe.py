"""Lesson 02: GPipe over M micro-batches, with and without activation checkpointing, trains exactly
like the unsplit model on the whole batch; forgetting the micro-batch scale would not."""

import pytest
import torch
import torch.nn.functional as F

from distlab.compare import all_ok, compare
from distlab.models import layered_mlp, regression_batch
from distlab.pipeline.runner import train_pipeline
from distlab.reference import sgd_reference
from distlab.runtime import spawn

# 16 layers: 8 or 4 per stage, so K = 2 checkpoint segments of 4 or 2 layers really recompute
# (a one-layer segment of this MLP saves and recomputes nothing; see probe.py).
WIDTHS = (6, *[8] * 15, 4)
BATCH, STEPS, LR, SEED = 13, 3, 0.2, 3  # 13 rows: uneven micro-batches for every M > 1


def _train_configs(rt, schedule, configs, batch=BATCH, steps=STEPS, **kwargs):
    """One process group, several (M, K) runs: spawning once per configuration costs more than
    the training itself."""
    return [train_pipeline(rt, WIDTHS, batch, steps, LR, schedule=schedule, microbatches=m,
                           checkpoint_segments=k, seed=SEED, probe=True, gather_spans=False, **kwargs)
            for m, k in configs]


def _reference(batch=BATCH, steps=STEPS):
    x, target = regression_batch(batch, WIDTHS[0], WIDTHS[-1], seed=SEED)
    return sgd_reference(layered_mlp(WIDTHS, seed=SEED), x, target, F.mse_loss, steps, LR)


def _merged(runs, field):
    return {n: t for run in runs for n, t in getattr(run, field).items()}


def check_matrix(schedule, world_size):
    """Every (M, K) in the issue's matrix equals the reference; returns the runs by (M, K)."""
    ms = sorted({1, world_size - 1, world_size, 2 * world_size + 1})
    configs = [(m, k) for m in ms for k in (0, 2)]
    per_rank = spawn(_train_configs, world_size, schedule, configs)
    ref = _reference()
    assert ref.losses[-1] < ref.losses[0]  # it trains, so equal parameters mean something
    runs = {}
    for c, config in enumerate(configs):
        ranks = [per_rank[r][c] for r in range(world_size)]
        assert all_ok(compare(ref.first_grads, _merged(ranks, "first_grads"))), config  # 1e-10
        assert all_ok(compare(ref.params, _merged(ranks, "params"))), config
        assert torch.allclose(torch.tensor(ranks[0].losses), torch.tensor(ref.losses), rtol=1e-10, atol=0)
        runs[config] = ranks
    for m in ms:  # checkpointing did something: fewer bytes held, more layer forwards
        plain, ckpt = runs[(m, 0)], runs[(m, 2)]
        assert all(c.saved_peak_bytes < p.saved_peak_bytes for p, c in zip(plain, ckpt))
        assert all(c.layer_forwards > p.layer_forwards for p, c in zip(plain, ckpt))
    return runs


@pytest.mark.parametrize("world_size", [2, 4])
def test_gpipe_equals_the_unsplit_model_and_holds_all_m_microbatches(world_size):
    runs = check_matrix("gpipe", world_size)
    for (m, _), ranks in runs.items():
        assert [r.peak_in_flight for r in ranks] == [m] * world_size  # measured while running


def test_forgetting_the_microbatch_scale_gives_m_times_the_gradient():
    """The bug a loss curve hides: backward on each micro-batch mean as it is (seed 004) sums M
    means. Our comparison catches it, and the factor is exactly M for even micro-batches."""
    m, batch = 4, 12
    runs = spawn(_train_configs, 2, "gpipe", [(m, 0)], batch=batch, steps=1, scale_loss=False)
    got = _merged([r[0] for r in runs], "first_grads")
    ref = _reference(batch=batch, steps=1)
    assert not all_ok(compare(ref.first_grads, got))
    assert all_ok(compare({n: m * g for n, g in ref.first_grads.items()}, got))


def _errors(rt, cases):
    """Each bad configuration's error message, as every rank saw it (none may hang)."""
    messages = []
    for widths, kwargs in cases:
        try:
            train_pipeline(rt, widths, BATCH, 1, LR, **kwargs)
            messages.append("no error")
        except ValueError as err:
            messages.append(str(err))
    return messages


def test_bad_input_fails_identically_on_every_rank_before_any_message():
    cases = [
        (WIDTHS, dict(microbatches=0)),
        (WIDTHS, dict(microbatches=BATCH + 1)),
        (WIDTHS, dict(microbatches=2, checkpoint_segments=1)),
        (WIDTHS, dict(schedule="1f1b", microbatches=-3)),
        ((6, 5, 4), dict(microbatches=2)),  # 2 layers on 3 ranks
        (WIDTHS, dict(microbatches=2, input_features=7)),
    ]
    per_rank = spawn(_errors, 3, cases)
    assert per_rank[0] == per_rank[1] == per_rank[2]
    expected = ["at least one micro-batch", "at least one sample", "K = 1 would checkpoint nothing",
                "at least one micro-batch", "more stages than layers", "does not fit the model"]
    for message, phrase in zip(per_rank[0], expected):
        assert phrase in message
