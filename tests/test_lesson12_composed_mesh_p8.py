"""Lesson 12 under torchrun at P = 8, read at 80 columns: 2 x 2 x 2 over dp, pp, tp and context parallelism
with the other three (1 x 2 x 2 x 2), each equal to one process (float64, 1e-10), the mesh's groups, bytes,
model states and activations per rank equal to their formulas, and a torch.distributed.checkpoint saved at
2 x 2 x 2 x 1 resumed bit-identical at the same shape and to 1e-10 at 4 x 1 x 2 x 1: every claim the lesson
prints. A smaller model than the lesson's default (L = 2, two steps) to stay near a minute; the two other
shapes with cp at P = 8 (2x2x1x2, 2x1x2x2) run in test_lesson12_composed_mesh_p8_cp.py."""

from composed_helpers import SMALL_FLAGS as SMALL
from helpers import assert_lesson_passes_at_80_columns


def test_2x2x2_and_1x2x2x2_equal_one_process_and_resume_across_shapes():
    out = assert_lesson_passes_at_80_columns("12_composed_mesh.py", 8, "--shapes", "1x2x2x2", *SMALL)
    for claim in (
        "PASS  2x2x2x1: loss, parameters, gradients, AdamW states = one process (1e-10)",
        "PASS  1x2x2x2: loss, parameters, gradients, AdamW states = one process (1e-10)",
        "PASS  resumed at 2x2x2x1: bit-identical to the uninterrupted run",
        "PASS  resumed at 4x1x2x1: parameters, AdamW states = one process (1e-10)",
    ):
        assert claim in out, out
