"""The exercises' judge: a learner's function run on real ranks, its lesson's claims checked against
the single-process reference, and one readable line when a claim fails.

Each lesson has an exercise, `lessons/exercises/NN_<lesson>.py`: the one function that is the lesson's
mechanism, with the lesson's own signature, its body a `raise NotImplementedError("not written yet: ...")`.
Its test, `tests/test_exerciseNN_<lesson>.py`, writes a `check(answer)` that spawns the lesson's ranks,
runs the answer there and records named claims; `exercise_tests(...)` turns that into two tests:

- `test_exercise`: the check on the lessons' own function (plain `pytest`: the solution must pass), or on
  the learner's file (`pytest --exercises`: what the learner wrote is judged);
- `test_the_judge_rejects_a_blank_and_a_wrong_answer` (plain `pytest` only): the untouched blank fails with
  "not written yet", and a deliberately wrong answer (off by 1/P, a detached block, ...) fails the claim it
  breaks, so the check is one that can fail.

A failure reads "claim '<name>' failed on rank(s) ...: <by how much>. Hint: <one hint>", not a traceback.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from distlab.spawn import spawn

ROOT = Path(__file__).resolve().parent.parent
LESSONS, EXERCISES = ROOT / "lessons", ROOT / "lessons" / "exercises"


@dataclass(frozen=True)
class Answer:
    """A function to judge, named by its file and name (a lesson's file name starts with a digit, so
    `import` cannot reach it; the ranks load it from its path)."""

    path: Path
    name: str

    def load(self) -> Callable[..., Any]:
        module_name = f"answer_{self.path.parent.name}_{self.path.stem}"
        if module_name not in sys.modules:
            spec = importlib.util.spec_from_file_location(module_name, self.path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[module_name] = module
            spec.loader.exec_module(module)
        return getattr(sys.modules[module_name], self.name)

    def is_blank(self) -> bool:
        """True while the function's body still raises NotImplementedError (the exercise untouched)."""
        for node in ast.walk(ast.parse(self.path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == self.name:
                return any(isinstance(n, ast.Raise) and "NotImplementedError" in ast.unparse(n) for n in ast.walk(node))
        return False


def solution(lesson: str, name: str) -> Answer:
    return Answer(LESSONS / f"{lesson}.py", name)


def exercise(lesson: str, name: str) -> Answer:
    return Answer(EXERCISES / f"{lesson}.py", name)


@dataclass
class Claims:
    """The claims one rank checks, in order; the failed ones carry their place, by how much and a hint."""

    failed: list[tuple[int, str, str, str]] = field(default_factory=list)
    made: int = 0

    def check(self, claim: str, ok: bool, amount: str = "", hint: str = "") -> bool:
        self.made += 1
        if not ok:
            self.failed.append((self.made, claim, amount, hint))
        return bool(ok)

    def check_worst(self, claim: str, errors: dict[str, float], hint: str, bound: float = 1e-10) -> bool:
        """One claim over many tensors: it holds when the largest relative error (name -> error) is below
        `bound`; a failure names the worst tensor."""
        worst = max(errors, key=errors.get)
        return self.check(claim, errors[worst] < bound, f"{worst}: relative error {errors[worst]:.2e}", hint)


def _rank(rt, body: Callable[..., None], answer: Answer, args: tuple) -> dict:
    """One rank: load the answer, run the check's body with it, report what failed (or that it is blank)."""
    claims = Claims()
    try:
        body(rt, answer.load(), claims, *args)
    except NotImplementedError as err:
        return {"blank": str(err) or f"{answer.name} in {answer.path.name}"}
    return {"failed": claims.failed}


def judge(body: Callable[..., None], world_size: int, answer: Answer, *args: Any) -> None:
    """Run `body(rt, fn, claims, *args)` on `world_size` spawned ranks (gloo), `fn` the answer's function;
    fail the test with one line: what is not written yet, or the first claim that failed, on which ranks,
    by how much, and its hint."""
    reports = spawn(_rank, world_size, body, answer, args, timeout_s=60, limit_s=240)
    blank = next((r["blank"] for r in reports if "blank" in r), None)
    if blank is not None:
        text = blank if blank.startswith("not written yet") else f"not written yet: {blank}"
        pytest.fail(f"{answer.path.name}: {text}", pytrace=False)
    # the earliest claim that failed anywhere (the ranks make the same claims in the same order)
    for _, claim, amount, hint in sorted(f for r in reports for f in r["failed"]):
        ranks = [r for r, rep in enumerate(reports) if any(f[1] == claim for f in rep["failed"])]
        pytest.fail(
            f"{answer.path.name}: claim '{claim}' failed on rank(s) {', '.join(map(str, ranks))}"
            f"{': ' + amount if amount else ''}. Hint: {hint}",
            pytrace=False,
        )


def exercise_tests(
    lesson: str,
    name: str,
    check: Callable[[Answer], None],
    wrong: Answer,
    wrong_claim: str,
    solution_at: Answer | None = None,
) -> tuple[Callable, Callable]:
    """The two tests of an exercise (see the module docstring). `wrong` is a deliberately wrong answer;
    `wrong_claim` the claim it must fail; `solution_at` where the solution is when the lesson calls it
    from the library rather than defining it (default: the lesson's own function of that name)."""

    @pytest.mark.exercise
    def test_exercise(source: str) -> None:
        if source == "solution":
            check(solution_at or solution(lesson, name))
        else:
            check(exercise(lesson, name))

    def test_the_judge_rejects_a_blank_and_a_wrong_answer() -> None:
        blank = exercise(lesson, name)
        with pytest.raises(pytest.fail.Exception, match=wrong_claim):
            check(wrong)
        if not blank.is_blank():
            pytest.skip(f"{blank.path.name} is written: its blank is no longer there to judge")
        with pytest.raises(pytest.fail.Exception, match="not written yet"):
            check(blank)

    return test_exercise, test_the_judge_rejects_a_blank_and_a_wrong_answer


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
