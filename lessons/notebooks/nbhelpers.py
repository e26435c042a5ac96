"""What the read-along notebooks share, so no notebook pastes another's code.

- `run_lesson("02_gpipe_checkpoint.py", 2, "--micro-batches", "8")`: the lesson under torchrun, its
  output shown as the lesson printed it (captured, so laid out at a generous width and with one
  final line instead of progress-bar redraws); raises if the lesson's claim failed.
- `gantt(ax, rows, ...)`: a schedule or timeline as a Gantt chart (pipeline lessons).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

LESSONS = Path(__file__).resolve().parent.parent


def run_lesson(lesson: str, nproc: int, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run `lessons/<lesson>` with `nproc` ranks under torchrun and print what it printed."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("COLUMNS", None)  # captured output: the lesson picks its generous captured width ...
    if os.environ.get("DISTLAB_LESSON_COLUMNS"):  # ... unless the test suite asks for a narrow one
        env["COLUMNS"] = os.environ["DISTLAB_LESSON_COLUMNS"]
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node", str(nproc), str(LESSONS / lesson), *map(str, args)],
                         capture_output=True, text=True, env=env, cwd=LESSONS.parent)
    print(run.stdout, end="")
    if run.returncode != 0:
        print(run.stderr[-3000:], end="", file=sys.stderr)
        if check:
            raise RuntimeError(f"{lesson} exited with {run.returncode}")
    return run
