"""No lesson hangs at exit: lesson 27 twenty times in a row at P = 3 (N = 258), then every lesson three
times at P = 3, each run under a wall-clock limit, and a count of how each run ended.

    python benchmarks/teardown_check.py                 # both parts; writes benchmarks/results/teardown_check.md
    python benchmarks/teardown_check.py --repeat 20 --per-lesson 0    # only lesson 27

Why. Lesson 27 (then lesson 23) hung at exit in about 3 of 7 runs at P = 3: its DDP outlived the
process group in `main()`'s frame, so DDP's C++ reducer became the group's last owner and destroyed
it with the GIL held, while a gloo worker thread held the group's mutex and waited for the GIL to free
a tensor Python had dropped (`distlab.processes.runtime.release_process_group` has the whole story; the test
`test_release_frees_ddp_before_its_group_so_exit_cannot_hang` builds that state on purpose).

A run "hangs" when it has not exited within --limit seconds after it started; a hang is killed and
counted, never waited for. The lessons run with fewer steps than their defaults (the LIGHT flags
below), so the check fits a loaded 2-core machine: exit is what is tested, and every lesson still
passes its claims. A lesson that refuses P = 3 (exit 2 with its one-line error) is listed as such.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
P = 3
LESSON_16 = ("27_train_clip.py", ("--global-batch", "258", "--steps", "20", "--warmup", "2", "--eval-every", "10"))
LIGHT = {  # fewer steps and smaller timings than the defaults; the same code paths and claims
    "03_one_f_one_b.py": ("--micro-batches", "7"),
    "06_data_parallel.py": ("--steps", "2"),
    "22_contrastive_local_naive.py": ("--steps", "20", "--eval-every", "10"),
    "24_grad_cache.py": ("--repeats", "1"),
    "27_train_clip.py": LESSON_16[1],
}


def run_once(lesson: str, args: tuple[str, ...], limit_s: float) -> dict:
    """One torchrun of a lesson: how it ended ('exit 0', 'exit N', 'hang') and how long it took."""
    env = dict(os.environ, OMP_NUM_THREADS="1", COLUMNS="80")
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(P),
        str(ROOT / "lessons" / lesson),
        *args,
    ]
    start = time.monotonic()
    proc = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=limit_s)
        ended = f"exit {proc.returncode}"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)  # torchrun and its ranks: this run's own session, nothing else
        out, _ = proc.communicate()
        ended = "hang"
    passed = "PASS: every claim holds" in out
    refused = proc.returncode == 2 and "error:" in out
    return {
        "lesson": lesson,
        "args": list(args),
        "ended": ended,
        "passed": passed,
        "refused_p3": refused,
        "seconds": round(time.monotonic() - start, 1),
        "tail": out.strip().splitlines()[-3:],
    }


def lessons() -> list[str]:
    return sorted(path.name for path in (ROOT / "lessons").glob("[0-9][0-9]_*.py"))


def summary(runs: list[dict]) -> list[str]:
    """One markdown row per lesson: runs, clean exits, hangs, other exits, seconds (min-max)."""
    rows = ["| lesson | runs | PASS and exit 0 | hang | other | seconds |", "|---|---|---|---|---|---|"]
    for lesson in dict.fromkeys(r["lesson"] for r in runs):
        mine = [r for r in runs if r["lesson"] == lesson]
        clean = sum(r["ended"] == "exit 0" and r["passed"] for r in mine)
        hangs = sum(r["ended"] == "hang" for r in mine)
        refused = all(r["refused_p3"] for r in mine)
        other = "refuses P = 3" if refused else str(len(mine) - clean - hangs)
        seconds = [r["seconds"] for r in mine]
        rows.append(f"| {lesson} | {len(mine)} | {clean} | {hangs} | {other} | {min(seconds):.0f}-{max(seconds):.0f} |")
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=20, help="runs of lesson 27 in a row")
    parser.add_argument("--per-lesson", type=int, default=3, help="runs of every lesson")
    parser.add_argument("--limit", type=float, default=600.0, help="seconds before a run counts as hung")
    parser.add_argument("--only", nargs="*", default=None, metavar="LESSON", help="these lesson files only")
    parser.add_argument("--out", type=Path, default=RESULTS / "teardown_check", help="output stem (.md, .json)")
    args = parser.parse_args()
    runs, load = [], os.getloadavg()
    plan = [LESSON_16] * args.repeat + [
        (name, LIGHT.get(name, ()))
        for name in lessons()
        if args.only is None or name in args.only
        for _ in range(args.per_lesson)
    ]
    for k, (lesson, flags) in enumerate(plan, 1):
        runs.append(run_once(lesson, flags, args.limit))
        r = runs[-1]
        print(
            f"[{k}/{len(plan)}] {lesson} {' '.join(flags)}: {r['ended']}, "
            f"{'PASS' if r['passed'] else 'no PASS'}, {r['seconds']:.0f} s",
            flush=True,
        )
    hangs = sum(r["ended"] == "hang" for r in runs)
    header = [
        f"# Teardown check: P = {P}, {len(runs)} runs, {hangs} hung",
        "",
        f"`python benchmarks/teardown_check.py --repeat {args.repeat} --per-lesson {args.per_lesson}`; "
        f"a run hangs if it has not exited after {args.limit:.0f} s. Load average at the start "
        f"{load[0]:.1f}, at the end {os.getloadavg()[0]:.1f} (2 cores, shared).",
        "",
        f"Lesson 27 first, {args.repeat} runs in a row with `{' '.join(LESSON_16[1])}`; then every "
        "lesson with the flags in `LIGHT`.",
        "",
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text("\n".join(header + summary(runs)) + "\n")
    args.out.with_suffix(".json").write_text(json.dumps(runs, indent=1))
    print("\n".join(summary(runs)))
    return 1 if hangs else 0


if __name__ == "__main__":
    sys.exit(main())
