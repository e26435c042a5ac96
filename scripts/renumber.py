"""Put the lessons in the order `lessons/order.txt` gives: rename their files and rewrite every reference.

`lessons/order.txt` names each lesson by its slug (`data_parallel` for `lessons/06_data_parallel.py`), one a
line, in the arc's order; line k (counting from 1, blank and `#` lines skipped) is lesson k. This script makes
the tree agree with it:

- renames, for every lesson whose number changes, its lesson file `lessons/NN_<slug>.py`, notebook
  `lessons/notebooks/NN_<slug>.ipynb`, exercise `lessons/exercises/NN_<slug>.py` and test files
  `tests/test_lessonNN_*.py`, `tests/test_exerciseNN_*.py`;
- rewrites, in every text file of the tree but the records of past runs (`benchmarks/results/` keeps the
  numbers the lessons had when they ran), `NN_<slug>` (always to the slug's number, so a stale number is
  fixed too), `test_lessonNN` / `test_exerciseNN`, `--exercises -k NN`, "lesson 14", "Lessons 10-16",
  "exercises 06, 08 and 10", "notebook 13" (each number through the move; a range only where the moved range
  is a range again), and in the README's lesson table the row's number and its "builds on" cell ("06's
  collectives", "12, 13"), re-sorting the table's rows;
- reports what it cannot rewrite: a range that the move breaks apart, a number that names no lesson, and a
  bare "NN's" of a moved lesson outside the table (a sentence it cannot be sure is about a lesson).

The numbers come from the lesson files themselves, so a second run finds every number already in place and
changes nothing (idempotent). Text is rewritten before files are renamed, every file in one pass.

    python scripts/renumber.py            # rename and rewrite, then report
    python scripts/renumber.py --check    # change nothing; exit 1 if anything would change or is reported

Not part of the library: it edits the repository, it is not imported by it.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ORDER = Path("lessons") / "order.txt"
SKIP_DIRS = {".git", "runs", "__pycache__", ".ipynb_checkpoints", ".pytest_cache", ".ruff_cache", "venv", ".venv"}
SELF = {"scripts/renumber.py", "tests/test_renumber.py"}  # their examples ("lesson 14") are not references
RECORDS = "benchmarks/results/"  # what a past run printed keeps the numbers the lessons had when it ran
TEXT_SUFFIXES = {".py", ".md", ".ipynb", ".sh", ".txt", ".toml", ".json", ".cfg", ".yml", ".yaml", ".rst"}
LESSON_FILE = re.compile(r"^(\d\d)_(\w+)\.py$")
WORDS = r"[Ll]essons?|[Ee]xercises?|[Nn]otebooks?"
SEP = r"(?:\s*,\s*(?:and\s+|or\s+)?|\s+and\s+|\s+or\s+|\s*[-\u2013]\s*|\s+to\s+)"
# "lessons 10-16, 18 and 20": the word, then numbers all written two-digit, or all written bare.
WORD_LIST = re.compile(rf"\b({WORDS})(\s+)(\d\d(?:{SEP}\d\d)*(?!\d)|[1-9]\d?(?:{SEP}[1-9]\d?)*(?!\d))")
TEST_FILE = re.compile(r"\btest_(lesson|exercise)(\d\d)(?=_)")
EXERCISE_K = re.compile(r"(--exercises\s+-k\s+)(\d\d)(?!\d)")  # `pytest --exercises -k 10`
TABLE_ROW = re.compile(r"^\| (\d\d) \| [^|]*\((?:\.\./)?lessons/\d\d_\w+\.py\)")  # a lesson table's row (README, docs/)
POSSESSIVE = re.compile(r"(?<![\w.\-])(\d\d)'s\b")


def read_order(root: Path) -> list[str]:
    """The slugs of `lessons/order.txt`, in order; a repeated slug is an error."""
    lines = (root / ORDER).read_text().splitlines()
    slugs = [s.strip() for s in lines if s.strip() and not s.strip().startswith("#")]
    repeated = sorted({s for s in slugs if slugs.count(s) > 1})
    if repeated:
        raise SystemExit(f"{ORDER}: {', '.join(repeated)} listed more than once")
    return slugs


def current_numbers(root: Path, slugs: list[str]) -> dict[str, int]:
    """Each slug's number now, read from its lesson file; every lesson file must be in the order and back."""
    found: dict[str, int] = {}
    for path in sorted((root / "lessons").glob("[0-9][0-9]_*.py")):
        number, slug = LESSON_FILE.match(path.name).groups()
        if slug in found:
            raise SystemExit(f"two lesson files for {slug!r}: numbers {found[slug]:02d} and {number}")
        found[slug] = int(number)
    missing, unlisted = [s for s in slugs if s not in found], [s for s in found if s not in slugs]
    if missing or unlisted:
        raise SystemExit(
            f"{ORDER} and lessons/ disagree: no lesson file for {missing or 'none'}; "
            f"not in the order: {unlisted or 'none'}"
        )
    return found


class Rewriter:
    """The move `old number -> new number` applied to text, remembering what it could not rewrite."""

    def __init__(self, old: dict[str, int], new: dict[str, int]):
        self.new_of_slug = new
        self.move = {old[s]: new[s] for s in old}
        self.moved = {n for n, m in self.move.items() if n != m}
        names = "|".join(sorted(new, key=len, reverse=True))  # the longest first: no slug eats another's prefix
        self.slug = re.compile(rf"(?<![0-9A-Za-z_])(\d\d)_({names})(?![A-Za-z0-9])")
        self.reports: list[str] = []

    def _number(self, text: str, where: str) -> str:
        n = int(text)
        if n not in self.move:
            if self.moved:
                self.reports.append(f"{where}: {text!r} names no lesson; left as it is")
            return text
        return f"{self.move[n]:0{len(text)}d}"

    def _list(self, numbers: str, where: str) -> str:
        """Rewrite "10-16, 18 and 20": each number through the move, a range only if it stays a range."""
        parts = re.split(f"({SEP})", numbers)
        out = list(parts)
        for i in range(0, len(parts), 2):
            is_range_end = i >= 2 and re.fullmatch(r"\s*[-\u2013]\s*|\s+to\s+", parts[i - 1])
            if is_range_end:
                first, last = int(parts[i - 2]), int(parts[i])
                span = [self.move.get(n) for n in range(first, last + 1)]
                if None in span or sorted(span) != list(range(min(span), max(span) + 1)):
                    if any(n in self.moved for n in range(first, last + 1)):
                        self.reports.append(f"{where}: the range {parts[i - 2]}-{parts[i]} is no range after the move")
                    out[i - 2], out[i] = parts[i - 2], parts[i]
                    continue
                width = len(parts[i])
                out[i - 2], out[i] = f"{min(span):0{width}d}", f"{max(span):0{width}d}"
            else:
                out[i] = self._number(parts[i], where)
        return "".join(out)

    def _table_row(self, line: str, where: str) -> str:
        """The README's lesson table: the row's number and the numbers of its "builds on" cell."""
        cells = line.split(" | ")
        cells[0] = "| " + self._number(cells[0][2:], where)
        if len(cells) > 2:
            cells[2] = re.sub(r"\b\d\d(?:[-\u2013]\d\d)?\b", lambda m: self._list(m.group(0), where), cells[2])
        return " | ".join(cells)

    def text(self, text: str, where: str) -> str:
        text = self.slug.sub(lambda m: f"{self.new_of_slug[m.group(2)]:02d}_{m.group(2)}", text)
        text = TEST_FILE.sub(lambda m: f"test_{m.group(1)}{self._number(m.group(2), where)}", text)
        text = EXERCISE_K.sub(lambda m: m.group(1) + self._number(m.group(2), where), text)
        lines = text.split("\n")
        for k, line in enumerate(lines):
            spot = f"{where}:{k + 1}"
            if TABLE_ROW.match(line):
                lines[k] = self._table_row(line, spot)
                continue
            lines[k] = WORD_LIST.sub(lambda m, spot=spot: m.group(1) + m.group(2) + self._list(m.group(3), spot), line)
            for m in POSSESSIVE.finditer(line):
                if int(m.group(1)) in self.moved and not WORD_LIST.search(line[: m.end()]):
                    self.reports.append(f"{spot}: {m.group(0)!r} may name a lesson; check it by hand")
        return "\n".join(_sorted_tables(lines))


def _sorted_tables(lines: list[str]) -> list[str]:
    """Runs of lesson-table rows (`| NN | [title](lessons/NN_<slug>.py) ...`) sorted by their number, stable."""
    out, run = [], []
    for line in [*lines, None]:
        if line is not None and TABLE_ROW.match(line):
            run.append(line)
            continue
        out += sorted(run, key=lambda row: int(TABLE_ROW.match(row).group(1)))
        run = []
        if line is not None:
            out.append(line)
    return out


def text_files(root: Path) -> list[Path]:
    files = []
    for path in sorted(root.rglob("*")):
        relative = path.relative_to(root)
        if path.is_file() and path.suffix in TEXT_SUFFIXES and not SKIP_DIRS & set(relative.parts):
            if relative.as_posix() not in SELF and not relative.as_posix().startswith(RECORDS):
                files.append(path)
    return files


def renames(root: Path, rewriter: Rewriter, old: dict[str, int]) -> list[tuple[Path, Path]]:
    """(from, to) for every numbered file of a lesson whose number changes."""
    pairs = []
    for slug, n in old.items():
        m = rewriter.move[n]
        if m == n:
            continue
        for folder, suffix in (("lessons", ".py"), ("lessons/notebooks", ".ipynb"), ("lessons/exercises", ".py")):
            for p in (root / folder).glob(f"{n:02d}_{slug}{suffix}"):
                pairs.append((p, p.with_name(f"{m:02d}_{slug}{suffix}")))
        for kind in ("lesson", "exercise"):
            for p in (root / "tests").glob(f"test_{kind}{n:02d}_*.py"):
                pairs.append((p, p.with_name(f"test_{kind}{m:02d}_" + p.name.split("_", 2)[2])))
    return pairs


def renumber(root: Path, check: bool = False) -> tuple[list[str], list[str]]:
    """Make the tree at `root` agree with its order file; (what changed or would change, what is reported)."""
    slugs = read_order(root)
    old = current_numbers(root, slugs)
    rewriter = Rewriter(old, {s: k + 1 for k, s in enumerate(slugs)})
    changes, edits = [], {}
    for path in text_files(root):
        before = path.read_text(encoding="utf-8", errors="surrogateescape")
        after = rewriter.text(before, str(path.relative_to(root)))
        if after != before:
            edits[path] = after
            changes.append(f"rewrote {path.relative_to(root)}")
    moves = renames(root, rewriter, old)
    changes += [f"renamed {a.relative_to(root)} -> {b.relative_to(root)}" for a, b in moves]
    if not check:
        for path, after in edits.items():
            path.write_text(after, encoding="utf-8", errors="surrogateescape")
        parked = [(a.rename(a.with_name(a.name + ".renumbering")), b) for a, b in moves]  # no name is taken twice
        for a, b in parked:
            a.rename(b)
    return changes, rewriter.reports


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent, help="the tree")
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if anything would change")
    args = parser.parse_args(argv)
    changes, reports = renumber(args.root, args.check)
    for line in changes:
        print(("would have " if args.check else "") + line)
    for line in reports:
        print(f"cannot rewrite: {line}")
    print(f"{len(changes)} change(s), {len(reports)} reference(s) to check by hand")
    return 1 if args.check and (changes or reports) else 0


if __name__ == "__main__":
    sys.exit(main())
