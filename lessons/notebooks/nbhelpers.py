"""What the read-along notebooks share, so no notebook pastes another's code; and the one place that finds a
lesson by its slug and runs it under torchrun (the tests use these too: tests/helpers.py imports them).

- `lesson_path("data_parallel")`, `load_lesson("data_parallel")`: a lesson's file, and the file as a module,
  whatever its number; `torchrun("data_parallel", 2, ...)`: the lesson under torchrun, output captured;
- `run_lesson("gpipe_checkpoint", 2, "--micro-batches", "8")`: the lesson under torchrun (found by its slug), its
  output shown as the lesson printed it (captured, so laid out at a generous width and with one
  final line instead of progress-bar redraws); raises if the lesson's claim failed.
- `gantt(ax, timing, ...)`: a schedule's simulated grid as a Gantt chart, `timeline(ax, spans, ...)`:
  measured compute spans the same way (pipeline lessons 01-05, on the real CPU or the emulated device).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

LESSONS = Path(__file__).resolve().parent.parent


class LessonRun(subprocess.CompletedProcess):
    """`run_lesson`'s result: a CompletedProcess that a notebook shows as one line, not as its arguments and
    captured output (which hold this machine's paths and the lesson's escape codes as text)."""

    def __repr__(self) -> str:
        return f"<{self.lesson} under torchrun: exit {self.returncode}>"


def lesson_path(name: str, folder: Path = LESSONS, suffix: str = ".py") -> Path:
    """A lesson's file found by its slug, whatever its number: `lesson_path("data_parallel")` is
    lessons/06_data_parallel.py (so is "06_data_parallel" or "06_data_parallel.py": the number is ignored);
    `folder`, `suffix`: its exercise or notebook. lessons/order.txt sets the numbers (scripts/renumber.py)."""
    slug = re.sub(r"^\d\d_", "", Path(name).name.removesuffix(suffix))
    found = sorted(folder.glob(f"[0-9][0-9]_{slug}{suffix}"))
    if len(found) != 1:
        raise FileNotFoundError(f"{len(found)} files for lesson {name!r} in {folder}: {[p.name for p in found]}")
    return found[0]


def load_lesson(slug: str):
    """A lesson file as a module, found by its slug: `load_lesson("data_parallel")` (a numbered name,
    "06_data_parallel", works too; `lesson_path`). Its name starts with a digit, so `import` cannot reach it;
    its `main()` does not run. Loaded once per process."""
    path = lesson_path(slug)
    name = "lesson_" + path.stem
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def torchrun(
    lesson: str,
    nproc: int,
    *args: str,
    timeout: float | None = 300,
    columns: int | str | None = None,
    max_restarts: int = 0,
) -> subprocess.CompletedProcess:
    """Run the lesson (its slug, `lesson_path`'s) with `nproc` ranks under torchrun, output captured; returns the
    CompletedProcess. `columns`: the width the lesson lays its output out for (None: its own, a captured
    output's generous one); `max_restarts`: how often torchrun restarts every rank after one fails."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("COLUMNS", None)
    if columns is not None:
        env["COLUMNS"] = str(columns)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    command += ["--max-restarts", str(max_restarts), str(lesson_path(lesson)), *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, cwd=LESSONS.parent)


# The test suite's sizes (tests/test_notebooks.py): {slug: [P or null, [flags]]} as JSON. The suite executes a
# notebook to show that its cells run and read whole; the lesson's claims at the sizes the cells show are made
# by the lesson's own test file and run_all.sh, so the suite may run the lesson smaller (the flags are appended:
# the last of a flag wins) or at another P. The committed outputs are those of a run at the sizes shown.
SUITE_SIZES = "DISTLAB_NOTEBOOK_SIZES"


def suite_sizes(lesson: str, nproc: int, args: tuple) -> tuple[int, tuple]:
    """(P, flags) that `run_lesson` runs `lesson` with: as the notebook asks, unless DISTLAB_NOTEBOOK_SIZES
    names the lesson's slug."""
    sizes = json.loads(os.environ.get(SUITE_SIZES) or "{}")
    slug = re.sub(r"^\d\d_", "", lesson_path(lesson).stem)
    if slug not in sizes:
        return nproc, args
    world, flags = sizes[slug]
    return world or nproc, (*args, *flags)


def repeats(n: int) -> int:
    """How often a notebook's own timing cell repeats what it times: `n`, or once when the test suite executes
    the notebook (DISTLAB_NOTEBOOK_SIZES set), where the figures it prints are no claim and only the cell's
    running is checked."""
    return 1 if os.environ.get(SUITE_SIZES) else n


def run_lesson(lesson: str, nproc: int, *args: str, check: bool = True) -> LessonRun:
    """Run the lesson `lesson` (its slug, as `lesson_path` finds it) with `nproc` ranks under torchrun and
    print what it printed (the test suite may change the sizes: `suite_sizes`)."""
    nproc, args = suite_sizes(lesson, nproc, args)
    columns = os.environ.get("DISTLAB_LESSON_COLUMNS")  # the test suite may ask for a narrow width
    run = torchrun(lesson, nproc, *args, timeout=None, columns=columns)
    run = LessonRun(run.args, run.returncode, run.stdout, run.stderr)
    run.lesson = lesson
    print(run.stdout, end="")
    if run.returncode != 0:
        print(run.stderr[-3000:], end="", file=sys.stderr)
        if check:
            raise RuntimeError(f"{lesson} exited with {run.returncode}")
    return run


# --- pipeline lessons: Gantt charts ----------------------------------------------------------

COLORS = {"F": "tab:blue", "I": "tab:purple", "I split": "tab:red", "W": "tab:green"}


def gantt(ax, timing, title: str = "", stretch: float = 1.0, labels: bool = True, path: bool = False) -> None:
    """One row per rank, one box per action where `distlab.model_split.simulator.simulate` placed it.
    Forward blue, unsplit backward purple, split backward (the input's gradient) red, weight
    gradient green; a rank's second stage paler. Boxes are labelled with their micro-batch (and,
    one stage per rank, the kind: F3), short enough not to overlap. `path`: a black line through
    micro-batch 0's forwards, stage 0 to the last, which draws the placement (ZB-V: a V).
    `stretch` ticks of the x axis per grid tick (2 for a one-stage-per-rank grid beside grids of
    half-size stages)."""
    multi = len({a.stage for a in timing.start}) > len(timing.grid)
    split = {(a.stage, a.microbatch) for a in timing.start if a.kind == "W"}
    first = [min((a.stage for a in row if a), default=0) for row in timing.grid]
    for r, row in enumerate(timing.grid):
        for action in {a for a in row if a is not None}:
            start, width = timing.start[action], timing.finish[action] - timing.start[action]
            kind = "I split" if action.kind == "I" and (action.stage, action.microbatch) in split else action.kind
            ax.broken_barh(
                [(start * stretch, width * stretch)],
                (r - 0.4, 0.8),
                color=COLORS[kind],
                alpha=1.0 if action.stage == first[r] else 0.55,
                edgecolor="white",
                linewidth=0.5,
            )
            if labels:
                ax.text(
                    (start + width / 2) * stretch,
                    r,
                    str(action.microbatch) if multi else str(action),
                    ha="center",
                    va="center",
                    color="white",
                    fontsize=6,
                )
    if path:
        forwards = sorted((a for a in timing.start if a.kind == "F" and a.microbatch == 0), key=lambda a: a.stage)
        owner = {a: r for r, row in enumerate(timing.grid) for a in row if a is not None}
        ax.plot([(timing.start[a] + 0.5) * stretch for a in forwards], [owner[a] for a in forwards], "k-", lw=1.2)
    ax.set_yticks(range(len(timing.grid)), [f"rank {r}" for r in range(len(timing.grid))])
    ax.invert_yaxis()
    ax.set_xlim(0, timing.ticks * stretch)
    ax.set_title(f"{title}  bubble {timing.bubble_fraction():.3f}" if title else "", fontsize=9, loc="left")


def legend(ax) -> None:
    from matplotlib.patches import Patch

    names = {
        "F": "F: forward",
        "I": "I, unsplit: input and weight gradient",
        "I split": "I: input gradient",
        "W": "W: weight gradient",
    }
    ax.legend(
        handles=[Patch(color=c, label=names[k]) for k, c in COLORS.items()],
        fontsize=7,
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
    )


def timeline(ax, spans: list[dict], title: str = "") -> None:
    """Measured compute spans ({rank, label, start, end}) as a Gantt chart in milliseconds, coloured
    as `gantt` does (an I is split, red, when the run has W's)."""
    t0 = min(s["start"] for s in spans)
    split = any(s["label"][0] == "W" for s in spans)
    for s in spans:
        kind = "I split" if split and s["label"][0] == "I" else s["label"][0]
        ax.broken_barh(
            [(1e3 * (s["start"] - t0), 1e3 * (s["end"] - s["start"]))],
            (s["rank"] - 0.4, 0.8),
            color=COLORS[kind],
            edgecolor="white",
            linewidth=0.3,
        )
    ranks = sorted({s["rank"] for s in spans})
    ax.set_yticks(ranks, [f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("milliseconds")
    ax.set_title(title, fontsize=9, loc="left")


# --- lesson 26: the ring against the gather, on real ranks ----------------------------------


def ring_and_gather(rt, c: int, d: int, t: int) -> dict:
    """Lesson 26's own measurement (`loss_memory`) on one of P ranks: the loss machinery of {InfoNCE, sigmoid} x
    {gather, ring} on C x d random embeddings, its peak bytes and bytes sent, and the ring's timeline. Here
    because `distlab.processes.spawn` runs only a function importable by name."""
    return load_lesson("sigmoid_and_ring").loss_memory(rt, c, d, t)
