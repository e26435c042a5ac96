"""The code reads as a textbook, and stays that way (the rules are CONTRIBUTING.md's): one formatter and
linter (ruff, at the one line length pyproject.toml sets) for the whole tree; a lesson's or a benchmark's
main() fits on a screen; a lesson is as long as its idea, mechanism and proof need, within a budget; a
module elsewhere has one job and so stays short; a function takes few enough arguments to hold in mind;
and the tests share helpers through their helper modules, never by importing one another. (Which
module may import which: tests/test_layering.py.)"""

import ast
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LESSONS = sorted((ROOT / "lessons").glob("[0-9][0-9]_*.py"))
BENCHMARKS = sorted(p for p in (ROOT / "benchmarks").glob("*.py") if "def main(" in p.read_text())
LIBRARY = sorted((ROOT / "src").rglob("*.py"))
TESTS = sorted((ROOT / "tests").glob("*.py"))
MODULES = (
    LIBRARY
    + sorted(p for p in (ROOT / "lessons").rglob("*.py") if p not in LESSONS)
    + sorted((ROOT / "benchmarks").glob("*.py"))
    + TESTS
)
# A lesson holds idea, mechanism and proof (formatted, not packed); any other module holds one job. 480: lessons 10
# and 12 grew by the paragraphs that say what their numbers show (drops per rank, the crossover), not by code.
MAIN_LINES, LESSON_LINES, MODULE_LINES, PARAMETERS = 60, 480, 400, 7


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["check", "format"])
def test_ruff_passes_on_the_whole_tree(command):
    ruff = shutil.which("ruff")
    assert ruff, "ruff is not installed: pip install -r requirements.txt"
    done = subprocess.run([ruff, *command, "."], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, f"ruff {' '.join(command)} .:\n{done.stdout}{done.stderr}"


def _functions(path: Path):
    tree = ast.parse(path.read_text())
    return [node for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]


def _parameters(fn) -> int:
    args = fn.args
    names = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs]
    return len([n for n in names if n not in ("self", "cls")])


@pytest.mark.parametrize("path", LESSONS + BENCHMARKS, ids=lambda p: p.stem)
def test_a_lessons_main_fits_on_a_screen(path):
    mains = [fn for fn in _functions(path) if fn.name == "main"]
    assert mains, f"{path.name} has no main()"
    lines = mains[0].end_lineno - mains[0].lineno + 1
    assert lines <= MAIN_LINES, f"{path.name}: main() is {lines} lines (at most {MAIN_LINES})"


def test_modules_are_short_and_signatures_small():
    long = [
        f"{p.relative_to(ROOT)}: {n} lines (at most {cap})"
        for paths, cap in ((LESSONS, LESSON_LINES), (MODULES, MODULE_LINES))
        for p in paths
        if (n := len(p.read_text().splitlines())) > cap
    ]
    wide = [
        f"{p.relative_to(ROOT)}:{fn.lineno} {fn.name}() takes {_parameters(fn)}"
        for p in LESSONS + MODULES
        for fn in _functions(p)
        if _parameters(fn) > PARAMETERS
    ]
    assert not long, f"modules over their budget: {long}"
    assert not wide, f"functions over {PARAMETERS} parameters: {wide}"


def test_no_test_imports_another_test():
    offenders = []
    for path in TESTS:
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            offenders += [f"{path.name} imports {n}" for n in names if n.split(".")[0].startswith("test_")]
    assert not offenders, offenders
