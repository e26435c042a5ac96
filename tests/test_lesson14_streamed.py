"""Lesson 14 runs under torchrun: both loops' step-1 gradients (the learned scale's included) equal
the full batch's, the loss goes down, the largest temporary is an O(N d) one, at P = 3 with the
default batch; and a flag that fails a check needing the group is one clear line and exit code 2."""

import os
import subprocess
import sys

from distlab.spawn import free_port
from helpers import LESSONS, assert_lesson_passes_at_80_columns

LESSON = "14_streamed_five_phase.py"


def test_lesson_passes_at_p3_with_its_default_batch_and_uneven_micro_batches():
    # Defaults N = 960, B = 96, T = 128 at P = 3: C = 320 in 4 micro-batches of 80 (never 96, 96, 96, 32).
    out = assert_lesson_passes_at_80_columns(LESSON, 3, "--epochs", "2", "--dataset-size", "1920",
                                             "--normalisers", "replicated")
    assert "regime: recompute (B = 96 < C = 320): 4 micro-batches of 80 pairs" in " ".join(out.split())
    assert out.count("PASS ") == 5 and "Epoch 1, Step 1, Loss" in out and "learned tau" in out


def test_a_bad_config_is_one_clear_error_and_exit_code_2():
    # One rank without torchrun (the environment it would set): the error paths cost no launcher.
    # A flag that needs P is checked after the group exists, the same way on every rank.
    env = dict(os.environ, OMP_NUM_THREADS="1", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    run = subprocess.run([sys.executable, str(LESSONS / LESSON), "--dataset-size", "10"], capture_output=True,
                         text=True, env=env, timeout=120)
    out = run.stdout + run.stderr
    assert run.returncode == 2 and "Traceback" not in out, out[-3000:]
    assert "--dataset-size: must hold at least one global batch (N=960)" in out, out
