"""Lesson 11 runs under torchrun: its step-1 gradients equal the full batch's, its largest temporary
is below B x N, and a bad config fails with one clear line and exit code 2 on every rank."""

import os
import subprocess
import sys
from pathlib import Path

from distlab.runtime import free_port

LESSON = Path(__file__).parent.parent / "lessons" / "11_streamed_five_phase.py"


def _torchrun(nproc, *args):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", str(nproc), str(LESSON), *args],
                          capture_output=True, text=True, env=env, timeout=240)


def test_lesson_passes_with_uneven_micro_batches_and_replicated_phase_b():
    # C = 48 pairs per rank in micro-batches of 7 (the last one 6), chunks of 10 over N = 96.
    run = _torchrun(2, "--global-batch", "96", "--micro-batch", "7", "--chunk", "10", "--epochs", "2",
                    "--dataset-size", "384", "--phase-b", "replicated")
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    assert "PASS" in run.stdout and "Epoch 1, Step 3" in run.stdout
    assert "largest temporary the step made" in run.stdout


def test_a_bad_config_is_one_clear_error_and_exit_code_2():
    # One rank without torchrun (the env it would set): the error path costs no launcher.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    run = subprocess.run([sys.executable, str(LESSON), "--tau", "0", "--epochs", "1"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 2, run.stdout + run.stderr[-3000:]
    assert run.stdout.count("error:") == 1 and "must be a finite number > 0" in run.stdout, run.stdout
    assert "Traceback" not in run.stdout + run.stderr
