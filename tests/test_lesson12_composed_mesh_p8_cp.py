"""Lesson 12 under torchrun at P = 8 with context parallelism beside data parallelism: 2 x 1 x 2 x 2 and
2 x 2 x 1 x 2 equal to one process (float64, 1e-10), bytes, model states and activations per rank equal to
their formulas, and a checkpoint saved at 2 x 1 x 2 x 2 resumed bit-identical there and to 1e-10 at
4 x 1 x 1 x 2 (tp folded into dp). The smaller model of test_lesson12_composed_mesh_p8.py."""

from composed_helpers import SMALL_FLAGS as SMALL
from helpers import assert_lesson_passes_at_80_columns


def test_dp_and_cp_with_tp_or_pp_equal_one_process_and_resume_across_shapes():
    flags = ("--dp", "2", "--pp", "1", "--tp", "2", "--cp", "2", "--shapes", "2x2x1x2", *SMALL)
    out = assert_lesson_passes_at_80_columns("12_composed_mesh.py", 8, *flags)
    for claim in (
        "PASS  2x1x2x2: loss, parameters, gradients, AdamW states = one process (1e-10)",
        "PASS  2x2x1x2: loss, parameters, gradients, AdamW states = one process (1e-10)",
        "PASS  resumed at 2x1x2x2: bit-identical to the uninterrupted run",
        "PASS  resumed at 4x1x1x2: parameters, AdamW states = one process (1e-10)",
    ):
        assert claim in out, out
