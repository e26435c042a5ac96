"""The README scans in two minutes: at most 2,000 words, and its lesson table one line a lesson.

The table has exactly one row per lesson of lessons/order.txt, in that order, each on one line of at most
ROW_WORDS words: its number, the lesson's link, what it builds on, what it proves, and the command that runs it,
with a world size run_all.sh runs it at. docs/lessons.md keeps every lesson's whole row (the mechanism and every
claim), one row per lesson too. The README's two commands are the ones .ci/run runs, and every page it links is
there. Read as text, nothing imported or run; each check is shown to fail on a planted slip.
"""

import re

import pytest
from helpers import ROOT

README = ROOT / "README.md"
LESSONS_PAGE = ROOT / "docs" / "lessons.md"
MAX_WORDS = 2000
ROW_WORDS = 50  # one line of a wide terminal, a row that scans
ROW = re.compile(r"^\| (\d\d) \| \[[^]]*\]\((?:\.\./)?lessons/(\d\d)_(\w+)\.py\)")
COMMAND = re.compile(r"`torchrun --nproc-per-node (\d+) lessons/(\d\d)_(\w+)\.py`")
TWO_COMMANDS = ("pip install -r requirements.txt && ./run_all.sh", "pytest")


def order() -> list[str]:
    lines = (ROOT / "lessons" / "order.txt").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def run_all_sizes() -> dict[str, set[int]]:
    """slug -> the world sizes run_all.sh runs it at."""
    table = (ROOT / "run_all.sh").read_text().split("LESSONS=(")[1].split("\n)")[0]
    sizes: dict[str, set[int]] = {}
    for line in table.splitlines():
        if line.strip().startswith('"'):
            slug, p = line.strip().strip('"').split("|")[:2]
            sizes.setdefault(slug, set()).add(int(p))
    return sizes


def table_problems(text: str, slugs: list[str], sizes: dict[str, set[int]] | None, row_words: int | None) -> list:
    """What is wrong with a page's lesson table: a lesson with no row or more than one, rows out of order, a number
    that is not the lesson's, a row cut over two lines (its first line has too few cells), a row longer than
    `row_words`, and (with `sizes`) a run command missing or at a world size run_all.sh does not run."""
    problems, seen = [], []
    for line in text.splitlines():
        if not re.match(r"^\| \d\d \|", line):
            continue
        m = ROW.match(line)
        if m is None:
            problems.append(f"not a lesson row: {line[:60]!r}")
            continue
        number, file_number, slug = m.groups()
        seen.append(slug)
        if slug not in slugs or number != file_number or int(number) != slugs.index(slug) + 1:
            problems.append(f"row {number} links lesson {file_number}_{slug}, lesson {slugs.index(slug) + 1:02d}")
        if line.count("|") < 5 or not line.rstrip().endswith("|"):  # four cells at least: number, lesson, ..., proves
            problems.append(f"row {number} is cut short: {line[-40:]!r}")
        if row_words is not None and len(line.split()) > row_words:
            problems.append(f"row {number} has {len(line.split())} words (more than {row_words})")
        if sizes is not None:
            run = COMMAND.search(line)
            if run is None or run.group(2, 3) != (number, slug):
                problems.append(f"row {number} has no command that runs it")
            elif int(run.group(1)) not in sizes.get(slug, set()):
                problems.append(f"row {number} runs at P = {run.group(1)}, run_all.sh at {sorted(sizes.get(slug, []))}")
    if seen != slugs:
        problems.append(f"rows {seen} are not one per lesson of lessons/order.txt, in order")
    return problems


def readme_problems(text: str) -> list[str]:
    problems = table_problems(text, order(), run_all_sizes(), ROW_WORDS)
    words = len(text.split())
    problems += [f"{words} words (at most {MAX_WORDS})"] if words > MAX_WORDS else []
    block = text.split("```bash\n", 1)[1].split("```", 1)[0] if "```bash\n" in text else ""
    commands = [line.split("#")[0].strip() for line in block.splitlines()]
    problems += [f"the two commands are not {TWO_COMMANDS}"] if commands[:2] != list(TWO_COMMANDS) else []
    links = re.findall(r"\]\(((?:docs|lessons)/[^)#]*)\)", text) + ["CONTRIBUTING.md"]
    problems += [f"links {link}, which is not there" for link in links if not (ROOT / link).exists()]
    return problems


def test_the_readme_scans():
    text = README.read_text()
    assert not readme_problems(text), readme_problems(text)
    assert len(text.split()) > 500  # the check reads the real README


def test_ci_runs_the_readme_commands():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert all(command in ci for command in TWO_COMMANDS), ci


def test_docs_lessons_keeps_every_lesson_whole():
    text = LESSONS_PAGE.read_text()
    assert not table_problems(text, order(), None, None), table_problems(text, order(), None, None)
    assert len(text.split()) > 2 * len(order()) * ROW_WORDS  # the whole rows, not the README's short ones


def first_row(text: str) -> str:
    return next(line for line in text.splitlines() if line.startswith("| 01 |"))


@pytest.mark.parametrize(
    "slip,found",
    [
        (lambda t: t + " word" * MAX_WORDS, "words (at most"),
        (lambda t: t.replace(first_row(t), first_row(t) + "\n" + first_row(t)), "not one per lesson"),
        (lambda t: t.replace(first_row(t), ""), "not one per lesson"),
        (lambda t: t.replace(first_row(t), first_row(t).replace(" | -", " |\n| -")), "cut short"),
        (lambda t: t.replace(first_row(t), first_row(t) + " more" * ROW_WORDS), "words (more than"),
        (lambda t: t.replace("--nproc-per-node 4 lessons/01", "--nproc-per-node 3 lessons/01"), "run_all.sh at"),
        (lambda t: t.replace("./run_all.sh   #", "./run_all.sh --fast   #"), "the two commands"),
        (lambda t: t.replace("(docs/losses.md)", "(docs/loses.md)"), "not there"),
    ],
)
def test_the_readme_check_fails_on_a_slip(slip, found):
    planted = slip(README.read_text())
    assert any(found in problem for problem in readme_problems(planted)), readme_problems(planted)
