"""scripts/rooms.py on a small tree that still has the old paths (as a branch written before the move has): the
loose modules move into their rooms, every import and `distlab.x` reference is rewritten (a name split out of
the lessons' parser goes to its owner), the records of past runs are left alone, a second run changes nothing,
and the real tree is already in its rooms."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from helpers import ROOT

SCRIPT = ROOT / "scripts" / "rooms.py"

LESSON = '''"""A lesson written before the rooms (distlab.runtime, src/distlab/cli.py)."""

from distlab import compat, emulate
from distlab.cli import (
    DTYPES,
    lesson_parser,
    positive_int,
)
from distlab.runtime import Runtime, distributed
from distlab.streamed.step import distributed_backward  # a package that did not move
import distlab.verdict as verdict


def main():
    with mock.patch("distlab.memory.PeakMemory"):
        return distlab.console.print0, distlab.runtimes  # `runtimes` is no module of the map
'''

REWRITTEN = '''"""A lesson written before the rooms (distlab.processes.runtime, src/distlab/proof/cli.py)."""

from distlab.comm import compat
from distlab.proof import emulate
from distlab.proof.compare import DTYPES
from distlab.proof.cli import lesson_parser
from distlab.processes.flags import positive_int
from distlab.processes.identity import Runtime
from distlab.processes.runtime import distributed
from distlab.streamed.step import distributed_backward  # a package that did not move
import distlab.proof.verdict as verdict


def main():
    with mock.patch("distlab.proof.memory.PeakMemory"):
        return distlab.processes.console.print0, distlab.runtimes  # `runtimes` is no module of the map
'''


def rooms(root: Path, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--root", str(root), *flags], capture_output=True, text=True, timeout=120
    )


def old_tree(tmp_path: Path) -> Path:
    tree = tmp_path / "tree"
    distlab = tree / "src" / "distlab"
    distlab.mkdir(parents=True)
    (distlab / "__init__.py").write_text('"""distlab."""\n')
    for name in ("runtime", "cli", "memory", "step_cost"):
        (distlab / f"{name}.py").write_text(f'"""{name}."""\nfrom distlab.console import print0\n')
    (distlab / "tensor_parallel").mkdir()  # a package moves too, file by file
    (distlab / "tensor_parallel" / "__init__.py").write_text('"""Lesson 08."""\n')
    (distlab / "tensor_parallel" / "cost.py").write_text("from distlab.tensor_parallel.model import Block\n")
    (tree / "lessons").mkdir()
    (tree / "lessons" / "01_fake.py").write_text(LESSON)
    notebook = {
        "cells": [
            {
                "cell_type": "code",
                "metadata": {},
                "source": ["from distlab import spawn\n", "spawn.spawn(f, 2)"],
                "outputs": [{"output_type": "stream", "name": "stdout", "text": ["distlab.spawn said so\n"]}],
                "execution_count": 1,
            },
        ],
        "metadata": {},
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    (tree / "lessons" / "01_fake.ipynb").write_text(json.dumps(notebook, indent=1) + "\n")
    (tree / "benchmarks" / "results").mkdir(parents=True)
    (tree / "benchmarks" / "results" / "old.md").write_text("ran with distlab.runtime and src/distlab/cli.py\n")
    return tree


def test_the_modules_move_and_every_reference_follows(tmp_path):
    tree = old_tree(tmp_path)
    first = rooms(tree)
    assert first.returncode == 0, first.stderr
    distlab = tree / "src" / "distlab"
    assert sorted(p.name for p in distlab.iterdir()) == [
        "__init__.py",
        "contrastive",
        "layer_split",
        "processes",
        "proof",
    ]
    moved = distlab / "layer_split" / "tensor_parallel"
    assert (moved / "cost.py").read_text() == "from distlab.layer_split.tensor_parallel.model import Block\n"
    assert (moved / "__init__.py").read_text() == '"""Lesson 08."""\n'
    assert (distlab / "layer_split" / "__init__.py").read_text().startswith('"""The layer split')
    assert (distlab / "processes" / "runtime.py").is_file() and (distlab / "proof" / "cli.py").is_file()
    assert (distlab / "contrastive" / "measured_step.py").is_file()
    for room in ("processes", "proof", "contrastive"):  # a missing room's __init__.py is made, with a docstring
        assert (distlab / room / "__init__.py").read_text().startswith('"""')
    assert (distlab / "proof" / "memory.py").read_text().endswith("from distlab.processes.console import print0\n")
    assert (tree / "lessons" / "01_fake.py").read_text() == REWRITTEN
    cell = json.loads((tree / "lessons" / "01_fake.ipynb").read_text())["cells"][0]
    assert cell["source"] == ["from distlab.processes import spawn\n", "spawn.spawn(f, 2)"]
    assert cell["outputs"][0]["text"] == ["distlab.spawn said so\n"]  # what a past run printed stays
    record = "ran with distlab.runtime and src/distlab/cli.py\n"
    assert (tree / "benchmarks" / "results" / "old.md").read_text() == record
    assert "moved src/distlab/runtime.py -> src/distlab/processes/runtime.py" in first.stdout

    second = rooms(tree, "--check")
    assert second.returncode == 0 and "nothing to move or rewrite" in second.stdout, second.stdout


def test_a_branch_merged_after_the_move_is_rewritten_only(tmp_path):
    """The lead's case: the modules moved already, a merged lesson still says the old paths, and a merged branch
    added a file to a package at its old place."""
    tree = old_tree(tmp_path)
    assert rooms(tree).returncode == 0
    (tree / "lessons" / "02_late.py").write_text(LESSON)
    check = rooms(tree, "--check")
    assert check.returncode == 1 and check.stdout.splitlines() == ["rewrote lessons/02_late.py"]
    assert rooms(tree).returncode == 0
    assert (tree / "lessons" / "02_late.py").read_text() == REWRITTEN
    late = tree / "src" / "distlab" / "tensor_parallel" / "async_tp.py"
    late.parent.mkdir()
    late.write_text("from distlab.tensor_parallel import cost\n")
    assert rooms(tree).returncode == 0 and not late.parent.exists()
    moved = tree / "src" / "distlab" / "layer_split" / "tensor_parallel" / "async_tp.py"
    assert moved.read_text() == "from distlab.layer_split.tensor_parallel import cost\n"


def test_the_check_fails_on_an_old_path(tmp_path):
    tree = old_tree(tmp_path)
    check = rooms(tree, "--check")
    assert check.returncode == 1 and "rewrote lessons/01_fake.py" in check.stdout
    assert (tree / "src" / "distlab" / "runtime.py").is_file()  # --check changes nothing


def test_the_real_tree_is_in_its_rooms():
    check = rooms(ROOT, "--check")
    assert check.returncode == 0, check.stdout


def test_a_module_renamed_in_its_package_keeps_the_name_a_file_knew_it_by(tmp_path):
    """streamed's tile modules were renamed where they are (tiles -> torch_tiles), its guards moved behind one door
    (guards -> step_guards -> safeguards.step_call): a branch written before gets the new paths, and a module it
    imported from the package keeps its old name as an alias, so the code below the import still reads."""
    tree = tmp_path / "tree"
    streamed = tree / "src" / "distlab" / "streamed"
    streamed.mkdir(parents=True)
    for name in ("__init__", "torch_tiles", "step_guards", "config"):
        (streamed / f"{name}.py").write_text(f'"""{name}."""\n')
    late = tree / "tests" / "test_late.py"
    late.parent.mkdir()
    late.write_text(
        "from distlab.streamed import config, guards, tiles as t\n"
        "from distlab.streamed.tiles import Pairing\n"
        'patch("distlab.streamed.guards.ready_step")  # src/distlab/streamed/guards.py\n'
        "from distlab.streamed.step_guards import agree_gradients_finite, ready_step\n"
        "from distlab.streamed.sigmoid import Logits, sigmoid_gathered\n"
    )
    assert rooms(tree).returncode == 0
    assert late.read_text() == (
        "from distlab.streamed import config, torch_tiles as t\n"
        "from distlab.streamed.safeguards import step_call as guards\n"
        "from distlab.streamed.torch_tiles import Pairing\n"
        'patch("distlab.streamed.safeguards.step_call.ready_step")  # src/distlab/streamed/safeguards/step_call.py\n'
        "from distlab.streamed.safeguards.finite import agree_gradients_finite\n"  # a name split out of its module
        "from distlab.streamed.safeguards.step_call import ready_step\n"
        "from distlab.streamed.sigmoid import Logits\n"
        "from distlab.streamed.exchange import sigmoid_gathered\n"
    )
    assert rooms(tree, "--check").returncode == 0  # a second run changes nothing
