"""scripts/renumber.py on a temporary copy of the tree: a lesson added at the end of the arc and put after 09
(as expert parallelism was) renames every numbered file and rewrites every reference; a second run changes
nothing; a range the move breaks apart is reported, not guessed; and the real tree agrees with lessons/order.txt."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

from helpers import ROOT, lesson_path

SCRIPT = ROOT / "scripts" / "renumber.py"
FAKE = "fake_parallel"  # a slug no lesson has
ORDER = [s for s in (ROOT / "lessons/order.txt").read_text().split("\n") if s and not s.startswith("#")]
LAST = len(ORDER)  # the fake lesson's number before the move; after it, 10


def renumber(root: Path, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--root", str(root), *flags], capture_output=True, text=True, timeout=120
    )


def copy_of_tree(tmp_path: Path) -> Path:
    """The tracked and untracked-but-not-ignored files of the repository (no .git, no runs/)."""
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split("\n")
    tree = tmp_path / "tree"
    for name in filter(None, files):
        if (ROOT / name).is_file():
            (tree / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, tree / name)
    return tree


def add_fake_lesson(tree: Path) -> None:
    """What a helper adding a lesson leaves: lesson, notebook, exercise, two test files, a README row, an order
    line at the end; then the lead moves its line after context_parallel."""
    n = f"{LAST + 1:02d}"
    text = f'"""Lesson {n}: experts. Builds on lessons 06 and 09; its notebook runs {n}_{FAKE}.py."""\n'
    (tree / f"lessons/{n}_{FAKE}.py").write_text(text)
    (tree / f"lessons/exercises/{n}_{FAKE}.py").write_text(text)
    cell = f'run_lesson(\\"{n}_{FAKE}.py\\", 4)'
    (tree / f"lessons/notebooks/{n}_{FAKE}.ipynb").write_text('{"cells": ["' + cell + '"]}')
    (tree / f"tests/test_lesson{n}_{FAKE}.py").write_text(f'LESSON = "{n}_{FAKE}"  # lesson {n}\n')
    (tree / f"tests/test_exercise{n}_{FAKE}.py").write_text(f"# exercise {n}, beside lessons 14-16\n")
    readme = (tree / "README.md").read_text()
    last = next(line for line in readme.splitlines() if line.startswith(f"| {LAST:02d} |"))
    row = f"| {n} | [experts](lessons/{n}_{FAKE}.py): experts | 06's collectives, 09 | equal |"
    (tree / "README.md").write_text(readme.replace(last, last + "\n" + row))
    order = tree / "lessons/order.txt"
    order.write_text(order.read_text().replace("context_parallel\n", f"context_parallel\n{FAKE}\n"))


def test_the_real_tree_agrees_with_the_order_file():
    run = renumber(ROOT, "--check")
    assert run.returncode == 0, run.stdout + run.stderr
    assert lesson_path("data_parallel") == lesson_path("06_data_parallel.py") == ROOT / "lessons/06_data_parallel.py"


def test_run_all_has_a_row_for_every_lesson_of_the_order_and_none_else():
    order = [s for s in (ROOT / "lessons/order.txt").read_text().split("\n") if s and not s.startswith("#")]
    table = (ROOT / "run_all.sh").read_text().split("LESSONS=(")[1].split("\n)")[0]
    rows = [line.strip().strip('"').split("|")[0] for line in table.splitlines() if line.strip().startswith('"')]
    assert set(rows) == set(order), set(rows) ^ set(order)
    assert sorted(p.stem[3:] for p in (ROOT / "lessons").glob("[0-9][0-9]_*.py")) == sorted(order)


def test_a_lesson_added_last_moved_to_10_renames_and_rewrites_everything_and_twice_changes_nothing(tmp_path):
    tree = copy_of_tree(tmp_path)
    moved = {  # every numbered test file from lesson 10 on, and where the move puts it
        path.name: re.sub(r"(\d\d)", lambda m: f"{int(m.group(1)) + 1:02d}", path.name, count=1)
        for path in (ROOT / "tests").glob("test_*[0-9][0-9]_*.py")
        if int(re.search(r"(\d\d)", path.name).group(1)) >= 10
    }
    add_fake_lesson(tree)
    first = renumber(tree)
    assert first.returncode == 0, first.stderr
    for path in (
        f"lessons/10_{FAKE}.py",
        f"lessons/notebooks/10_{FAKE}.ipynb",
        f"lessons/exercises/10_{FAKE}.py",
        f"tests/test_lesson10_{FAKE}.py",
        f"tests/test_exercise10_{FAKE}.py",
        "lessons/09_context_parallel.py",
        *(f"lessons/{k + 2:02d}_{slug}.py" for k, slug in enumerate(ORDER[9:], start=9)),
        *(f"lessons/notebooks/{k + 2:02d}_{slug}.ipynb" for k, slug in enumerate(ORDER[9:], start=9)),
        *(f"tests/{name}" for name in moved.values()),
    ):
        assert (tree / path).is_file(), path
    assert not list(tree.glob(f"lessons/{LAST:02d}_{ORDER[-1]}.py")) and not list(tree.rglob("*.renumbering"))
    fake = (tree / f"lessons/10_{FAKE}.py").read_text()
    assert fake.startswith(f'"""Lesson 10: experts. Builds on lessons 06 and 09; its notebook runs 10_{FAKE}')
    assert "# exercise 10, beside lessons 15-17" in (tree / f"tests/test_exercise10_{FAKE}.py").read_text()
    k = ORDER.index("contrastive_global") + 2
    assert f"`pytest --exercises -k {k}`" in (tree / f"lessons/exercises/{k}_contrastive_global.py").read_text()
    assert f'"10_{FAKE}"  # lesson 10' in (tree / f"tests/test_lesson10_{FAKE}.py").read_text()
    readme = (tree / "README.md").read_text()
    rows = [line[:4] for line in readme.splitlines() if line[:2] == "| " and line[2:4].isdigit() and line[4:6] == " |"]
    assert rows == [f"| {k:02d}" for k in range(1, LAST + 2)]  # one lesson more, the table re-sorted
    assert f"| 10 | [experts](lessons/10_{FAKE}.py): experts | 06's collectives, 09 |" in readme
    first_contrastive = ORDER.index("contrastive_global") + 2
    layout = (tree / "docs" / "layout.md").read_text()  # the README's layout lives in docs/ now
    assert f"src/distlab/contrastive/    lessons {first_contrastive}-{LAST + 1}" in layout
    assert "rewrote README.md" in first.stdout and "rewrote lessons/order.txt" not in first.stdout
    assert f"the range 07-{LAST} is no range after the move" in first.stdout  # 06's "bridge to 07-NN" is reported
    second = renumber(tree, "--check")
    assert second.returncode == 0 and "0 change(s), 0 reference(s)" in second.stdout, second.stdout


def test_a_broken_order_file_is_refused_before_anything_changes(tmp_path):
    tree = copy_of_tree(tmp_path)
    order = tree / "lessons/order.txt"
    order.write_text(order.read_text() + "no_such_lesson\n")
    run = renumber(tree)
    assert run.returncode != 0 and "no lesson file for ['no_such_lesson']" in run.stderr
    order.write_text(order.read_text().replace("no_such_lesson\n", "sharding\n"))
    assert "sharding listed more than once" in renumber(tree).stderr
    assert (tree / "lessons/07_sharding.py").is_file()
