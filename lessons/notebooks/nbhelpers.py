"""What the read-along notebooks share, so no notebook pastes another's code.

- `run_lesson("gpipe_checkpoint", 2, "--micro-batches", "8")`: the lesson under torchrun (found by its slug), its
  output shown as the lesson printed it (captured, so laid out at a generous width and with one
  final line instead of progress-bar redraws); raises if the lesson's claim failed.
- `gantt(ax, timing, ...)`: a schedule's simulated grid as a Gantt chart, `timeline(ax, spans, ...)`:
  measured compute spans the same way (pipeline lessons 01-05, on the real CPU or the emulated device).
"""

from __future__ import annotations

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


def lesson_path(slug: str) -> Path:
    """The lesson file of `slug` ("data_parallel": lessons/06_data_parallel.py), whatever its number
    (lessons/order.txt sets the numbers); a numbered name ("06_data_parallel.py") works too."""
    slug = re.sub(r"^\d\d_", "", slug.removesuffix(".py"))
    found = sorted(LESSONS.glob(f"[0-9][0-9]_{slug}.py"))
    if len(found) != 1:
        raise FileNotFoundError(f"{len(found)} lesson files for {slug!r} in {LESSONS}")
    return found[0]


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
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("COLUMNS", None)  # captured output: the lesson picks its generous captured width ...
    if os.environ.get("DISTLAB_LESSON_COLUMNS"):  # ... unless the test suite asks for a narrow one
        env["COLUMNS"] = os.environ["DISTLAB_LESSON_COLUMNS"]
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(nproc),
            str(lesson_path(lesson)),
            *map(str, args),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=LESSONS.parent,
    )
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
    """One row per rank, one box per action where `distlab.pipeline.simulator.simulate` placed it.
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
    """On each of P ranks (under distlab.processes.spawn): the loss machinery of {InfoNCE, sigmoid} x {gather,
    ring} on C x d random embeddings, its peak bytes (PeakMemory) and bytes sent; and the ring's
    timeline (rank, step, event, time)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from distlab.proof.memory import PeakMemory
    from distlab.streamed import loss_machinery
    from distlab.streamed.exchange import step_ledger
    from distlab.streamed.ring import P2PRing, sigmoid_ring
    from distlab.streamed.sigmoid import Logits

    gen = torch.Generator().manual_seed(rt.rank)
    z_x, z_y = (F.normalize(torch.randn(c, d, generator=gen), dim=1) for _ in range(2))
    out = {}
    for loss in ("infonce", "sigmoid"):
        for exchange in ("gather", "ring"):
            config = {
                "GLOBAL_BATCH_SIZE": c * rt.world_size,
                "MICRO_BATCH_SIZE": c,
                "STREAM_CHUNK_SIZE": t,
                "TAU": 0.1,
                "EXCHANGE": exchange,
            }
            step_ledger.clear()
            with PeakMemory() as mem:
                loss_machinery(z_x, z_y, config, logit_bias=-10.0 if loss == "sigmoid" else None)
            out[loss, exchange] = (mem.peak_bytes, step_ledger.sent)
    ring = P2PRing(rt.world_size, rt.rank)
    dist.barrier()
    sigmoid_ring(ring, z_x, z_y, Logits(10.0, -10.0), t)
    out["events"] = [(rt.rank, k, what, when) for k, what, when in ring.events]
    return out
