"""Lesson 12 at P = 4: every pair of dimensions (dp pp, dp tp, dp cp, pp tp, pp cp, tp cp at degree 2 each)
equal to one process (float64, 1e-10: losses, parameters, step 1's gradients, AdamW states), bytes, model
states and activations per rank equal to their formulas. A smaller model than the lesson's (L = 2, two
steps) so that six shapes fit in one spawn; the lesson's own sizes run at P = 8 under run_all.sh."""

from dataclasses import replace

from composed_helpers import CFG, assert_every_shape_equals_one_process, shapes_against_one_process

from distlab.composed.config import small_shapes
from distlab.processes.spawn import spawn

SMALL = replace(CFG, model=replace(CFG.model, layers=2), steps=2)


def test_each_pair_of_dimensions_at_p4_equals_one_process():
    shapes = small_shapes(4)
    assert len(shapes) == 6 and all(sorted((s.dp, s.pp, s.tp, s.cp)) == [1, 1, 2, 2] and s.ep == 1 for s in shapes)
    per_rank = spawn(shapes_against_one_process, 4, shapes, SMALL, timeout_s=240)
    assert_every_shape_equals_one_process(per_rank, shapes, SMALL)
