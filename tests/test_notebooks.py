"""Every read-along notebook runs top to bottom, so none can rot, and what it shows reads whole:
no table cell cut short, no screenful of progress-bar redraws. The lessons the notebooks run take the smaller
sizes of SUITE_SIZES here (the claims they make are the same), and a timing cell repeats once."""

import json
import re
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).parent.parent / "lessons" / "notebooks").glob("*.ipynb"))
SCREENFUL = 40  # lines
# The running machine's paths (its user, checkout, temporary files), and escape codes printed as text (a repr's
# '\\x1b[1m', not the colour a notebook renders from a real ESC in a stream).
MACHINE_PATH = re.compile(r"(?<![\w.])(/work/|/home/|/root/|/Users/|/tmp/|/private/var/|[A-Z]:\\\\Users)")
RAW_ESCAPE = re.compile(r"\\x1b|\\u001b|\\033|\\e\[")
BAR = re.compile(r"━|\d+/\d+ .*\d+:\d\d:\d\d|\d+%\|")  # rich's or tqdm's progress redraws
# The lessons a notebook runs (nbhelpers.run_lesson) run here at smaller sizes: {slug: [P or None (the
# notebook's), flags appended (the last of a flag wins)]}. Executing a notebook shows that its cells run on what
# the lesson reports and that all they print reads whole at 80 columns; the lesson still exits 1 if a claim
# fails. Fewer sizes, no fewer claims: every claim the lesson makes at the notebook's sizes is made here too,
#   at P = 2: tensor_parallel, context_parallel, expert_parallel, ulysses, async_tensor_parallel (the emulated
#     device at 5 ms, not 20; their test files run the notebook's P = 4 command itself at 80 columns),
#     composed_mesh (the mesh's dimensions one at a time; its test files make every claim of the notebook's
#     P = 8 run at 80 columns, shape for shape);
#   at the notebook's P, with the sizes of the lesson's own test file (as wide a table per rank):
#     interleaved_zero_bubble (the emulated device at 0.5 ms a layer-pass, not 10), dualpipe (1 ms), data_parallel,
#     contrastive_global, contrastive_local_naive (4 steps), grad_cache, powersgd (6 steps, width 32),
#     activation_offloading (width 64, N = 64, 2 ms a layer-pass), train_clip (40 steps, as its test file trains
#     to the same 80% claim, InfoNCE and the sigmoid ring alike).
# The default sizes run in run_all.sh; the committed notebooks hold a run at the sizes their cells show.
SUITE_SIZES = {
    "composed_mesh": [2, ["--dp", "2", "--pp", "1", "--tp", "1", "--cp", "1"]],
    "interleaved_zero_bubble": [None, ["--emulate-ms", "0.5"]],
    "data_parallel": [
        None,
        ["--global-batch", "24", "--layers", "3", "--width", "8", "--message-mib", "0.01", "--repeats", "2"]
        + ["--bucket-mib", "0.0005", "--emulate-ms", "0.5"],
    ],
    "tensor_parallel": [2, []],
    "context_parallel": [2, []],
    "expert_parallel": [2, []],
    "ulysses": [2, []],
    "async_tensor_parallel": [2, ["--repeats", "1", "--emulate-ms", "5", "--link-ms", "5"]],
    "dualpipe": [None, ["--emulate-ms", "1"]],
    "contrastive_global": [None, ["--global-batch", "48"]],
    "powersgd": [None, ["--steps", "6", "--width", "32"]],
    "activation_offloading": [None, ["--width", "64", "--global-batch", "64", "--emulate-ms", "2"]],
    "grad_cache": [None, ["--global-batch", "96", "--micro-batch-size", "8", "--width", "512", "--repeats", "1"]],
    "train_clip": [None, ["--steps", "40", "--warmup", "4"]],
    "contrastive_local_naive": [
        None,
        ["--global-batch", "24", "--steps", "4", "--train-size", "96", "--held-out", "32", "--eval-every", "2"],
    ],
}


def outputs_text(notebook) -> list[str]:
    texts = []
    for cell in notebook["cells"]:
        for out in cell.get("outputs", []):
            texts.append("".join(out.get("text", "")) + "".join(out.get("data", {}).get("text/plain", "")))
    return texts


def check_outputs(notebook, name: str) -> None:
    for text in outputs_text(notebook):
        assert "\u2026" not in text, f"{name}: an output holds a truncated cell ('\u2026'):\n{text[:2000]}"
        bars = [line for line in text.splitlines() if BAR.search(line)]
        assert len(bars) <= SCREENFUL, f"{name}: {len(bars)} progress-bar lines in one output"
        where = MACHINE_PATH.search(text) or RAW_ESCAPE.search(text)
        assert where is None, f"{name}: an output holds a machine's path or a raw escape code: {where!r}"


def test_there_are_notebooks():
    assert NOTEBOOKS, "lessons/notebooks/ holds no notebook"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_outputs_read_whole(path):
    check_outputs(json.loads(path.read_text()), path.name)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes(path, monkeypatch):
    # The lessons the notebook runs (nbhelpers.run_lesson) lay out for 80 columns here, the width of
    # the narrowest terminal a learner reads them in: no cell of theirs may be cut short there either.
    monkeypatch.setenv("DISTLAB_LESSON_COLUMNS", "80")
    monkeypatch.setenv("DISTLAB_NOTEBOOK_SIZES", json.dumps(SUITE_SIZES))
    notebook = nbformat.read(path, as_version=4)
    # Executed in memory, from the notebook's own folder (the notebooks call ../NN_lesson.py);
    # the committed file keeps the outputs of the real run it was saved with.
    NotebookClient(
        notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
    ).execute()
    check_outputs(notebook, path.name)


def test_the_check_can_fail():
    cell = {"cells": [{"outputs": [{"text": "| global_pla\u2026 |"}]}]}
    with pytest.raises(AssertionError, match="truncated"):
        check_outputs(cell, "x")
    for text in ("CompletedProcess(args=['/work/u/x.py'])", "stdout='\\x1b[1mLesson'", "saved to /home/me/01.json"):
        with pytest.raises(AssertionError, match="machine's path or a raw escape"):
            check_outputs({"cells": [{"outputs": [{"text": text}]}]}, "x")
    check_outputs({"cells": [{"outputs": [{"text": "\x1b[1mLesson\x1b[0m: lessons/07.py, 2/4 = 0.5"}]}]}, "x")
    spam = {"cells": [{"outputs": [{"text": "\n".join(["train \u2501\u2501\u2501 3/10"] * 41)}]}]}
    with pytest.raises(AssertionError, match="progress-bar"):
        check_outputs(spam, "x")


ESCAPE = re.compile(r"\x1b\[[0-9;]*m")
PRINTED_LESSON = re.compile(r"\bLesson (\d\d)\b")  # the header each lesson prints, "Lesson 10: ..."
JSON_NAME = re.compile(r"\blesson(\d\d)\.json\b|[\"/](\d\d)\.json\b")


def printed_numbers(notebook: dict) -> tuple[set[str], set[str]]:
    """The lesson numbers a notebook's saved outputs print in a lesson's header, and those its code's JSON
    report names carry ("lesson10.json", "01.json")."""
    printed, named = set(), set()
    for cell in notebook["cells"]:
        if cell["cell_type"] == "code":
            named |= {a or b for a, b in JSON_NAME.findall("".join(cell["source"]))}
        for output in cell.get("outputs", []):
            text = "".join(output.get("text", "")) + "".join(output.get("data", {}).get("text/plain", ""))
            printed |= set(PRINTED_LESSON.findall(ESCAPE.sub("", text)))
    return printed, named


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_a_notebook_shows_its_own_lessons_number(path):
    """What a notebook's saved run printed is its own lesson's, under today's number (a notebook last run before
    a renumbering says so), and its JSON report is named for that number."""
    printed, named = printed_numbers(json.loads(path.read_text()))
    number = path.name[:2]
    assert named <= {number}, (path.name, named)
    assert number in printed or not printed, (path.name, printed)
    assert printed <= {number} | set(mentioned_lessons(path)), (path.name, printed)


def mentioned_lessons(path: Path) -> set[str]:
    """Lessons a notebook's own lesson names in its printout ("Lesson 22's ..."), which may appear beside its own."""
    lesson = next(path.parent.parent.glob(f"{path.name[:2]}_*.py"))
    return set(re.findall(r"\bLesson (\d\d)\b", lesson.read_text()))


def test_the_number_check_can_fail():
    stale = {"cells": [{"cell_type": "code", "source": ['run("--json", "lesson17.json")'], "outputs": []}]}
    stale["cells"][0]["outputs"] = [{"text": "\x1b[1mLesson \x1b[0m\x1b[1;36m17\x1b[0m: expert parallelism"}]
    assert printed_numbers(stale) == ({"17"}, {"17"})
