"""Lesson 03: 1F1B trains exactly like the unsplit model and holds at most min(M, P - s)
micro-batches on stage s, measured while it runs."""

import pytest

from distlab.pipeline.runner import microbatch_sizes, train_pipeline
from distlab.pipeline.schedules import one_f_one_b
from distlab.runtime import spawn
from test_lesson02_gpipe import BATCH, LR, SEED, WIDTHS, check_matrix


@pytest.mark.parametrize("world_size", [2, 4])
def test_one_f_one_b_equals_the_unsplit_model_with_at_most_p_minus_s_in_flight(world_size):
    runs = check_matrix("1f1b", world_size)
    for (m, _), ranks in runs.items():
        assert [r.peak_in_flight for r in ranks] == [min(m, world_size - s) for s in range(world_size)]


def _both(rt, m):
    return [train_pipeline(rt, WIDTHS, BATCH, 1, LR, schedule=name, microbatches=m, seed=SEED,
                           probe=True, gather_spans=False) for name in ("gpipe", "1f1b")]


def test_saved_activation_bytes_follow_the_rows_in_flight():
    """GPipe holds every row of the batch at its peak; 1F1B only the rows of the micro-batches in
    flight. The measured bytes (saved_tensors_hooks) scale exactly with those rows."""
    p, m = 4, 9
    per_rank = spawn(_both, p, m)
    sizes = microbatch_sizes(BATCH, m)  # 2, 2, 2, 2, 1, 1, 1, 1, 1
    for s, (gpipe_run, ofob_run) in enumerate(per_rank):
        rows = peak_rows = 0
        for action in one_f_one_b(p, m)[s]:
            rows += sizes[action.microbatch] * (1 if action.kind == "F" else -1)
            peak_rows = max(peak_rows, rows)
        assert ofob_run.saved_peak_bytes * BATCH == gpipe_run.saved_peak_bytes * peak_rows
        assert ofob_run.saved_peak_bytes < gpipe_run.saved_peak_bytes
