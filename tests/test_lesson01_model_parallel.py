"""Lesson 01: layers split across P ranks with send/recv train exactly like the unsplit model."""

import pytest
import torch
import torch.nn.functional as F

from distlab.compare import all_ok, compare
from distlab.models import layered_mlp, regression_batch
from distlab.pipeline.naive import train_model_parallel
from distlab.reference import sgd_reference
from distlab.runtime import SpawnError, spawn
from distlab.timeline import max_concurrency

WIDTHS = (6, 10, 12, 10, 8, 4)  # 5 layers: P = 4 leaves one stage with two layers
BATCH, STEPS, LR = 16, 4, 0.2


def _train_and_catch(rt, *args, **kwargs):
    """Run the lesson's training; a bad-input error comes back as a value, so the test can see
    that *every* rank raised it (and none is left waiting)."""
    try:
        return train_model_parallel(rt, *args, **kwargs)
    except ValueError as err:
        return f"ValueError: {err}"


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_gradients_and_parameters_equal_the_unsplit_model(world_size):
    runs = spawn(train_model_parallel, world_size, WIDTHS, BATCH, STEPS, LR, seed=3)
    x, target = regression_batch(BATCH, WIDTHS[0], WIDTHS[-1], seed=3)
    ref = sgd_reference(layered_mlp(WIDTHS, seed=3), x, target, F.mse_loss, STEPS, LR)

    got_grads = {n: g for run in runs for n, g in run.first_grads.items()}
    got_params = {n: p for run in runs for n, p in run.params.items()}
    assert all_ok(compare(ref.first_grads, got_grads))  # float64: rtol 1e-10, atol 1e-12
    assert all_ok(compare(ref.params, got_params))
    assert torch.allclose(torch.tensor(runs[0].losses), torch.tensor(ref.losses), rtol=1e-10, atol=0)
    assert ref.losses[-1] < ref.losses[0]  # the run trains, so matching parameters mean something
    assert max_concurrency(runs[0].spans) == 1


def test_the_check_would_catch_a_wrong_gradient():
    """Guard against a comparison that cannot fail: one step less is visibly different."""
    runs = spawn(train_model_parallel, 2, WIDTHS, BATCH, STEPS - 1, LR, seed=3)
    x, target = regression_batch(BATCH, WIDTHS[0], WIDTHS[-1], seed=3)
    ref = sgd_reference(layered_mlp(WIDTHS, seed=3), x, target, F.mse_loss, STEPS, LR)
    assert not all_ok(compare(ref.params, {n: p for r in runs for n, p in r.params.items()}))


def test_more_ranks_than_layers_fails_on_every_rank():
    messages = spawn(_train_and_catch, 3, (6, 5, 4), BATCH, STEPS, LR)
    assert len(set(messages)) == 1 and "more stages than layers" in messages[0]


def test_a_batch_that_does_not_fit_fails_on_every_rank():
    messages = spawn(_train_and_catch, 2, WIDTHS, BATCH, STEPS, LR, input_features=7)
    assert len(set(messages)) == 1
    assert "does not fit the model: stage 0" in messages[0]


def test_an_unhandled_error_names_its_rank():
    with pytest.raises(SpawnError, match="rank .* failed"):
        spawn(train_model_parallel, 2, WIDTHS, 0, STEPS, LR)
