"""The exercises' judge: a learner's function run on real ranks, its lesson's claims checked against the
single-process reference, and a diagnosis when a claim fails.

Each lesson has an exercise, `lessons/exercises/NN_<lesson>.py`: the one function that is the lesson's
mechanism, with the lesson's own signature, its body a `raise NotImplementedError("not written yet: ...")`.
Its test, `tests/test_exerciseNN_<lesson>.py`, describes an `Exercise`: a `body(rt, fn, claims, *args)` that
runs on each of P spawned ranks with `fn` the function judged and records the lesson's claims through
`exercise_claims.Claims` (numbers against plain autograd on the whole batch, and what the lesson claims
beyond numbers, seen through `exercise_watch.Watch`); a catalogue of `Mistake`s, each recognised by its
signature; and the exercise's own hints by level. `Exercise.tests` turns that into the tests:

- `test_exercise`: the lesson's own function must pass (plain `pytest`); with `pytest --exercises` the
  learner's file is judged instead, and a failure reads "claim '<name>' failed on rank(s) ...", what the
  judge saw, and hints up to `--hint-level` (0: none; default 1);
- `test_the_blank_is_not_written_yet`: the untouched blank fails with "not written yet";
- `test_the_judge_names_the_mistake[<mistake>]`: one wrong answer per catalogued mistake, written in the test
  file; the judge recognises that mistake and gives its hints, level by level;
- `test_the_judge_checks_beyond_numbers[<answer>]` (`Exercise.structure_test`): a wrong answer whose numbers
  are right fails the structural claim it breaks (memory, collectives, bytes, a schedule's shape), and only
  such claims;
- `test_the_judge_accepts_another_way[<answer>]` (`Exercise.accepts_test`): a right answer written another
  way than the lesson's (a functional collective, a library gather the lesson names) passes every claim.

The blank, the lesson's own answer and every wrong answer run in one spawn per world size (each rank judges
them in turn), so an exercise's tests cost one spawn per world size, not one per answer.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import importlib.util
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from exercise_claims import Hints
from exercise_ranks import _raised, _ran_by_rank, _rank
from exercise_signatures import Diagnosis, Findings, Mistake, diagnose, more_help
from exercise_trace import DEPARTS
from exercise_watch import ran_text
from helpers import lesson_path

from distlab.processes.spawn import SpawnError, spawn

ROOT = Path(__file__).resolve().parent.parent
LESSONS, EXERCISES = ROOT / "lessons", ROOT / "lessons" / "exercises"
DEFAULT_HINT_LEVEL = 1  # the idea, named; 0 for no help at all


def hint_level_default() -> int:
    return int(os.environ.get("DISTLAB_HINT_LEVEL", DEFAULT_HINT_LEVEL))


@dataclass(frozen=True)
class Answer:
    """A function to judge, named by its file and name (a lesson's file name starts with a digit, so
    `import` cannot reach it; the ranks load it from its path)."""

    path: Path
    name: str

    def module(self):
        module_name = f"answer_{self.path.parent.name}_{self.path.stem}"
        if module_name not in sys.modules:
            spec = importlib.util.spec_from_file_location(module_name, self.path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[module_name] = module
            spec.loader.exec_module(module)
        return sys.modules[module_name]

    def load(self) -> Callable[..., Any]:
        return getattr(self.module(), self.name)

    def is_blank(self) -> bool:
        """True while the function's body still raises NotImplementedError (the exercise untouched)."""
        for node in ast.walk(ast.parse(self.path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == self.name:
                return any(isinstance(n, ast.Raise) and "NotImplementedError" in ast.unparse(n) for n in ast.walk(node))
        return False


def solution(lesson: str, name: str) -> Answer:
    """`name` in the lesson `lesson` (its slug: `helpers.lesson_path`)."""
    return Answer(lesson_path(lesson, LESSONS), name)


def exercise(lesson: str, name: str) -> Answer:
    """`name` in the lesson's exercise, lessons/exercises/NN_<slug>.py."""
    return Answer(lesson_path(lesson, EXERCISES), name)


@contextlib.contextmanager
def swapped(answer: Answer, **names: Any):
    """Inside the block, the answer's module sees `names` in place of its own (a wrong answer written as
    the solution with one piece done wrong). A name the module lacks is an error, not a silent no-op."""
    module = answer.module()
    missing = [n for n in names if not hasattr(module, n)]
    if missing:
        raise AttributeError(f"{answer.path.name} has no {missing}: the wrong answer no longer fits the lesson")
    before = {n: getattr(module, n) for n in names}
    vars(module).update(names)
    try:
        yield before
    finally:
        vars(module).update(before)


def _departs(reports: list[dict]) -> str:
    """Where the answer first departs from the lesson's function: on the lowest rank where it does on its own
    (not on what arrived from another rank), while it runs (an operation, a name), else where what it left
    behind does."""
    found = [
        ("from another rank" in m["departs"], m["after"], r, m["departs"])
        for r, m in enumerate(reports)
        if m.get("departs")
    ]
    return f"{DEPARTS}on rank {min(found)[2]}, {min(found)[3]}" if found else ""


@dataclass(frozen=True)
class Verdict:
    """One answer's judgment: not written yet (`blank`), or every rank's findings and their diagnosis, at
    the world size `world` it was judged at (the first where a claim failed, else the last)."""

    answer: Answer
    blank: str | None
    findings: Findings | None
    diagnosis: Diagnosis | None
    world: int = 0
    raised: str | None = None  # the answer raised (or hung): what, on which rank, and where in its file


@dataclass(frozen=True)
class Exercise:
    """An exercise's judge: `body(rt, fn, claims, *args)` on `world` ranks, then on each of `also_at`
    (world sizes where the lesson's claims read differently: a factor (P - 1) that equals 2 (P - 1)/P at
    P = 2, a sub-group that is the whole world at P = 2; the body takes P from `rt.world_size` there), its
    catalogue of mistakes, its own hints (three levels, for a learner who has not started), `numbers` (a
    regex naming the claims about numbers, which a structural wrong answer must keep), the quantities a
    ratio is read in (`quantities(P)`: {"M": 4, "C": 3, ...}; P is always one), and where the solution is
    when the lesson calls it from the library (`solution_at`)."""

    lesson: str
    name: str
    body: Callable[..., None]
    world: int
    mistakes: tuple[Mistake, ...]
    hints: Hints
    numbers: str = "equal"
    args: tuple = ()
    solution_at: Answer | None = None
    also_at: tuple[int, ...] = ()
    quantities: Callable[[int], dict] | None = None

    def judge(self, answers: list[Answer]) -> list[Verdict]:
        """Every answer judged in one spawn per world size: at `world` first, and at each of `also_at` the
        answers that passed so far; an answer's verdict is its first failure's."""
        verdicts: dict[Answer, Verdict] = {}
        worlds = (self.world, *self.also_at)
        for world in worlds:
            pending = [a for a in dict.fromkeys(answers) if a not in verdicts]
            if not pending:
                break
            with tempfile.TemporaryDirectory(prefix="distlab-ran-") as logs:
                try:
                    reports = spawn(
                        _rank, world, self.body, pending, self.args, logs, self.judged(), timeout_s=60, limit_s=240
                    )
                except (SpawnError, TimeoutError) as err:
                    if len(pending) != 1:  # the authors' wrong answers, judged together: a crash there is a bug
                        raise
                    raised = _raised(err, pending[0], _ran_by_rank(logs, 0, world), logs)
                    verdicts[pending[0]] = Verdict(pending[0], None, None, None, world, raised)
                    continue
            quantities = {"P": world, **(self.quantities(world) if self.quantities else {})}
            for k, answer in enumerate(pending):
                mine = [rank[k] for rank in reports]
                blank = next((r["blank"] for r in mine if "blank" in r), None)
                if blank is not None:
                    verdicts[answer] = Verdict(answer, blank, None, None, world)
                    continue
                findings = Findings([r["seen"] for r in mine])
                diagnosis = diagnose(findings, self.mistakes, world, quantities, self.numbers)
                if diagnosis is not None:
                    departs = _departs(mine)
                    diagnosis = dataclasses.replace(
                        diagnosis, ran=tuple(ran_text(r["ran"]) for r in mine), departs=departs
                    )
                if diagnosis is not None or world == worlds[-1]:
                    verdicts[answer] = Verdict(answer, None, findings, diagnosis, world)
        return [verdicts[a] for a in answers]

    def message(self, verdict: Verdict, level: int) -> str | None:
        """What a learner reads: None when every claim held."""
        if verdict.blank is not None:
            text = verdict.blank if verdict.blank.startswith("not written yet") else f"not written yet: {verdict.blank}"
            lines = [f"{verdict.answer.path.name}: {text}"]
            lines += [f"  hint {k + 1}: {hint}" for k, hint in enumerate(self.hints[:level])]
            if level < len(self.hints):
                lines.append(more_help(level))
            return "\n".join(lines)
        where = f" (judged at P = {verdict.world})" if self.also_at else ""
        if verdict.raised is not None:
            lines = [f"{verdict.answer.path.name}{where}: {verdict.raised}"]
            lines += [f"  hint {k + 1}: {hint}" for k, hint in enumerate(self.hints[:level])]
            if level < len(self.hints):
                lines.append(more_help(level))
            return "\n".join(lines)
        if verdict.diagnosis is None:
            return None
        return f"{verdict.answer.path.name}{where}: {verdict.diagnosis.message(level, self.hints)}"

    def judged(self) -> Answer:
        return self.solution_at or solution(self.lesson, self.name)

    def tests(self, here: Path, wrong: dict[str, str]) -> tuple[Callable, Callable, Callable]:
        """The exercise's tests (module docstring). `wrong` maps each catalogued mistake's name to the wrong
        answer in the test file `here` that makes it."""
        names = [m.name for m in self.mistakes]
        if sorted(wrong) != sorted(names):
            raise ValueError(f"{self.lesson}: a wrong answer per mistake: mistakes {names}, answers for {list(wrong)}")
        _WRONG.setdefault((self.lesson, here), set()).update(Answer(here, n) for n in wrong.values())

        @pytest.mark.exercise
        def test_exercise(source: str, hint_level: int, request) -> None:
            start = time.monotonic()
            if source == "solution":  # judged in the spawn of the wrong answers: no spawn of its own
                verdict = self.group(here)[self.judged()]
            else:
                (verdict,) = self.judge([exercise(self.lesson, self.name)])
            seconds = time.monotonic() - start
            took = f"checked on {' and '.join(map(str, (self.world, *self.also_at)))} rank(s) in {seconds:.1f} s"
            text = self.message(verdict, hint_level)
            numbered = exercise(self.lesson, self.name).path.stem  # "21_contrastive_global": the summary's name
            request.config.stash.setdefault(TIMES, []).append((numbered, text is None, seconds))
            if text is not None:
                pytest.fail(f"{text}\n  ({took})", pytrace=False)

        def test_the_blank_is_not_written_yet() -> None:
            blank = exercise(self.lesson, self.name)
            if not blank.is_blank():
                pytest.skip(f"{blank.path.name} is written: its blank is no longer there to judge")
            verdict = self.group(here)[blank]
            assert verdict.blank is not None and "not written yet" in self.message(verdict, 0)

        @pytest.mark.parametrize("mistake", self.mistakes, ids=names)
        def test_the_judge_names_the_mistake(mistake: Mistake) -> None:
            verdict = self.group(here)[Answer(here, wrong[mistake.name])]
            got = verdict.diagnosis.mistake.name if verdict.diagnosis and verdict.diagnosis.mistake else None
            assert got == mistake.name, f"diagnosed {got!r}:\n{self.message(verdict, 3)}"
            for level in range(4):  # each level shows its hints and no more
                text = self.message(verdict, level)
                assert all((hint in text) == (k < level) for k, hint in enumerate(mistake.hints)), text

        return test_exercise, test_the_blank_is_not_written_yet, test_the_judge_names_the_mistake

    def structure_test(self, here: Path, structural: dict[str, str]) -> Callable:
        """`structural` maps a wrong answer in `here` to the claim (a regex) it breaks with its numbers
        right: it must fail that claim, and no claim matching `numbers`."""
        _WRONG.setdefault((self.lesson, here), set()).update(Answer(here, n) for n in structural)

        @pytest.mark.parametrize("name", list(structural))
        def test_the_judge_checks_beyond_numbers(name: str) -> None:
            findings = self.group(here)[Answer(here, name)].findings
            failed = findings.failed()
            assert any(re.search(structural[name], c) for c in failed), f"{name} passed {structural[name]!r}"
            numbers = [c for c in failed if re.search(self.numbers, c)]
            assert not numbers, f"{name} should keep the numbers right, but failed {numbers}"

        return test_the_judge_checks_beyond_numbers

    def accepts_test(self, here: Path, correct: list[str]) -> Callable:
        """`correct` names right answers in `here` written another way than the lesson's (another
        collective, a library function the lesson names, one extra barrier): each must pass every claim."""
        _WRONG.setdefault((self.lesson, here), set()).update(Answer(here, n) for n in correct)

        @pytest.mark.parametrize("name", correct)
        def test_the_judge_accepts_another_way(name: str) -> None:
            verdict = self.group(here)[Answer(here, name)]
            assert verdict.blank is None and verdict.diagnosis is None, self.message(verdict, 3)

        return test_the_judge_accepts_another_way

    def planted(self, second: bool = False) -> Answer:
        """This exercise's slip of the audit (tests/exercise_slips.py's `SLIPS`, or with `second` the second
        audit's, tests/exercise_new_slips.py), planted in the judged solution."""
        from exercise_new_slips import NEW_SLIPS
        from exercise_slips import SLIPS, Planted

        slip, judged = (NEW_SLIPS if second else SLIPS)[self.name], self.judged()
        return Planted(judged.path, judged.name, slip.old, slip.new, slip.what, slip.within)

    def audit_test(self, here: Path, second: bool = False) -> Callable:
        """The audit (lessons/exercises/README.md): the slip planted in the solution must fail a claim (or
        raise: a verdict naming its line); with the slip's `names` given, the first hint (level 1) must name
        it, by those words. `second`: the second audit's slip, judged in the same spawn as the first."""
        from exercise_new_slips import NEW_SLIPS
        from exercise_slips import SLIPS

        slip = (NEW_SLIPS if second else SLIPS)[self.name]
        _WRONG.setdefault((self.lesson, here), set()).add(self.planted(second))

        @pytest.mark.xfail(bool(slip.missed), reason=slip.missed, strict=True)
        def test_the_judge_rejects_a_planted_slip() -> None:
            verdict = self.group(here)[self.planted(second)]
            text = self.message(verdict, 1)
            assert text is not None, f"the planted slip passed every claim: {slip.what}"
            if slip.names:
                assert re.search(slip.names, text), f"the first hint does not name {slip.what!r}:\n{text}"

        return test_the_judge_rejects_a_planted_slip

    def group(self, here: Path) -> dict[Answer, Verdict]:
        """The blank, the lesson's own answer and every wrong answer in `here`, judged once in one spawn per
        world size (cached per module)."""
        key = (self.lesson, here)
        if key not in _GROUPS:
            blank = exercise(self.lesson, self.name)
            # a written exercise is the learner's to judge with --exercises, never in the wrong answers' spawn
            wrong = sorted(_WRONG[key], key=lambda a: (a.path.name, a.name, getattr(a, "old", "")))
            answers = [blank] * blank.is_blank() + [self.judged()] + wrong
            try:
                verdicts = self.judge(answers)
            except (SpawnError, TimeoutError):  # the audit's slip may raise (the authors' answers never do):
                from exercise_slips import Planted

                slips = [a for a in answers if isinstance(a, Planted)]  # judged alone, its verdict names the line
                if not slips:
                    raise
                others = [a for a in answers if not isinstance(a, Planted)]
                verdicts = self.judge(others) + [v for a in slips for v in self.judge([a])]
            _GROUPS[key] = {v.answer: v for v in verdicts}
        return _GROUPS[key]


_GROUPS: dict = {}  # (lesson, test file) -> {answer: verdict}
_WRONG: dict = {}  # (lesson, test file) -> its wrong answers (and right ones written another way, and the slip)
TIMES = pytest.StashKey[list]()  # (lesson, passed, seconds) of each exercise judged, for the summary


@dataclass(frozen=True)
class Embeddings:
    """A contrastive batch for the exercises: unit-norm N x d Z_x, Z_y (float64, N = P C, the same on
    every rank), this rank's rows, leaf copies of its blocks (z_x, z_y) and of the whole (for the reference)."""

    full_x: torch.Tensor
    full_y: torch.Tensor
    rows: slice
    z_x: torch.Tensor
    z_y: torch.Tensor

    @classmethod
    def of(cls, rank: int, world_size: int, c: int, d: int, seed: int) -> Embeddings:
        gen = torch.Generator().manual_seed(seed)
        full = [
            torch.nn.functional.normalize(torch.randn(world_size * c, d, generator=gen, dtype=torch.float64), dim=1)
            for _ in range(2)
        ]
        rows = slice(rank * c, (rank + 1) * c)
        return cls(*full, rows, *(z[rows].clone().requires_grad_() for z in full))

    def whole(self) -> tuple:
        """Leaf copies of the whole Z_x, Z_y: the single-process reference's inputs."""
        return tuple(z.clone().requires_grad_() for z in (self.full_x, self.full_y))
