"""Stage splitting and shape derivation, without processes."""

import pytest
import torch

from distlab.model_split.partition import boundary_shapes, split_stages, stage_bounds
from distlab.proof.models import layered_mlp


@pytest.mark.parametrize("layers", range(1, 13))
def test_every_stage_is_contiguous_nonempty_and_first_stages_get_the_extra_layer(layers):
    for stages in range(1, layers + 1):
        bounds = stage_bounds(layers, stages)
        assert [i for b in bounds for i in b] == list(range(layers))
        sizes = [len(b) for b in bounds]
        assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1
        assert sizes == sorted(sizes, reverse=True)


def test_a_ceiling_split_would_leave_a_rank_empty_ours_does_not():
    layers, ranks = 6, 4
    per_rank = -(-layers // ranks)  # ceil(layers / P) layers from rank * ceil(layers / P)
    ceiling_sizes = [max(0, min((r + 1) * per_rank, layers) - r * per_rank) for r in range(ranks)]
    assert ceiling_sizes == [2, 2, 2, 0]
    assert [len(b) for b in stage_bounds(layers, ranks)] == [2, 2, 1, 1]


def test_more_stages_than_layers_is_a_clear_error():
    with pytest.raises(ValueError, match="more stages than layers"):
        stage_bounds(3, 4)
    with pytest.raises(ValueError, match="at least one stage"):
        stage_bounds(3, 0)


def test_stages_share_the_models_layers_under_global_names():
    model = layered_mlp((4, 5, 6, 7), seed=0)
    stages = split_stages(model, 2)
    names = [n for s in stages for n, _ in s.module.named_parameters()]
    assert names == [n for n, _ in model.named_parameters()]  # '2.weight' on stage 1, as in the model
    assert stages[1].module[0] is model[2]
    x = torch.randn(3, 4, dtype=torch.float64)
    assert torch.equal(stages[1].module(stages[0].module(x)), model(x))


def test_boundary_shapes_follow_the_widths_and_reject_a_batch_that_does_not_fit():
    stages = split_stages(layered_mlp((4, 5, 6, 7), seed=0), 3)
    assert boundary_shapes(stages, (10, 4), torch.float64) == [(10, 4), (10, 5), (10, 6), (10, 7)]
    with pytest.raises(ValueError, match=r"does not fit the model: stage 0"):
        boundary_shapes(stages, (10, 3), torch.float64)
