"""The indexes of the contrastive losses stay true: the streamed package's docstring names every module it holds (the
kernels' docstring every kernel module, the safeguards' every guard module), and docs/losses.md names each loss
where it lives: every name in a row's first column is defined in a file its second column names, every lesson's own
is defined in that lesson, and the public import path's losses are all there. Each check is shown to fail on a
planted slip.

Read from the source (ast, no import), so the kernels' files are read without Triton.
"""

import ast
import re
from pathlib import Path

import pytest
from helpers import ROOT

STREAMED = ROOT / "src" / "distlab" / "streamed"
INDEX = ROOT / "docs" / "losses.md"
PUBLIC_LOSSES = ("distributed_backward", "distributed_train_step", "ClipLoss", "SigLipLoss")  # distributed_clip's
TICKED = re.compile(r"`([A-Za-z_][\w.]*)`")
FILE = re.compile(r"`([\w/]+\.py)`")


def modules_of(package: Path) -> set[str]:
    """The modules and subpackages of a package, by name."""
    files = {p.stem for p in package.glob("*.py") if p.name != "__init__.py"}
    return files | {p.name for p in package.iterdir() if (p / "__init__.py").is_file()}


def unnamed_modules(package: Path, docstring: str) -> set[str]:
    return modules_of(package) - {name.split(".")[0] for name in TICKED.findall(docstring)}


def docstring_of(package: Path) -> str:
    return ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""


def defined_in(path: Path) -> set[str]:
    """The names a module defines at its top level: functions, classes, assignments."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return names


def table_rows(text: str) -> list[tuple[list[str], list[str]]]:
    """(the names of the first column, the .py files of the second) for every row of the page's tables."""
    rows = []
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if not line.startswith("| `") or len(cells) < 3:
            continue
        files = FILE.findall(cells[1])
        rows.append((TICKED.findall(cells[0]), files))
    return rows


def misplaced(text: str) -> list[str]:
    """Every name a table row lists that none of the row's files defines (or a file that is not there)."""
    wrong = []
    for names, files in table_rows(text):
        paths = [ROOT / ("src" if f.startswith("distlab/") else "") / f for f in files]
        wrong += [str(path) for path in paths if not path.is_file()] + ([] if files else [f"{names}: no file"])
        defined = set().union(*(defined_in(path) for path in paths if path.is_file()))
        wrong += [f"{name} (in {', '.join(files)})" for name in names if name not in defined]
    return wrong


def lessons_own(text: str) -> list[tuple[str, str]]:
    """(lesson number, name) for every "lesson NN's `name`" of the page's last part."""
    part = text.split("## The lessons' own", 1)[1]
    return [
        (number, name)
        for number, names in re.findall(r"lesson (\d\d)'s (.*?)(?=,\s+lesson \d\d's|\.\s*$)", part, re.S)
        for name in TICKED.findall(names)
    ]


def missing_in_lessons(text: str) -> list[str]:
    wrong = []
    for number, name in lessons_own(text):
        lesson = next((ROOT / "lessons").glob(f"{number}_*.py"))
        wrong += [] if name in defined_in(lesson) else [f"{name} (lesson {number})"]
    return wrong


def test_the_streamed_docstring_names_every_module():
    for package in (STREAMED, STREAMED / "kernels", STREAMED / "safeguards"):
        assert not unnamed_modules(package, docstring_of(package)), package
    assert len(modules_of(STREAMED)) >= 15 and len(modules_of(STREAMED / "safeguards")) >= 5  # the real packages


def test_the_module_check_fails_on_a_module_left_out():
    doc = docstring_of(STREAMED).replace("`rank_work`", "rank_work")
    assert unnamed_modules(STREAMED, doc) == {"rank_work"}


def test_every_loss_on_the_page_lives_where_the_page_says():
    text = INDEX.read_text()
    assert len(table_rows(text)) >= 15 and not misplaced(text), misplaced(text)
    assert len(lessons_own(text)) >= 10 and not missing_in_lessons(text), missing_in_lessons(text)
    listed = {name for names, _ in table_rows(text) for name in names}
    assert set(PUBLIC_LOSSES) <= listed


@pytest.mark.parametrize(
    "slip",
    [
        ("`distlab/streamed/ring_passes.py` |", "`distlab/streamed/exchange.py` |"),  # a loss put in the wrong file
        ("`distlab/contrastive/grad_cache.py`", "`distlab/contrastive/grad_cash.py`"),  # a file not there
        ("`sigmoid_gathered`", "`sigmoid_gathers`"),  # a name that is nowhere
    ],
)
def test_the_page_check_fails_on_a_slip(slip):
    text = INDEX.read_text()
    assert slip[0] in text
    assert misplaced(text.replace(*slip))


def test_the_lessons_check_fails_on_a_name_in_the_wrong_lesson():
    text = INDEX.read_text().replace("lesson 26's `sigmoid_loss`", "lesson 25's `sigmoid_loss`")
    assert "sigmoid_loss (lesson 25)" in missing_in_lessons(text)
