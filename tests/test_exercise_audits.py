"""The audits' slips still fit the lessons they were planted in: each `old` is found exactly once in its function
(`Planted.load`), so `scripts/audit_slips.py` can judge every audit again; a lesson changed under a slip fails
here, not silently in the audit."""

import functools
import importlib
from pathlib import Path

import pytest
from exercise_fifth_slips import FIFTH_SLIPS
from exercise_fourth_slips import FOURTH_SLIPS
from exercise_new_slips import NEW_SLIPS
from exercise_slips import SLIPS, Planted
from exercise_third_slips import THIRD_SLIPS

HERE = Path(__file__).parent
AUDITS = {"first": SLIPS, "second": NEW_SLIPS, "third": THIRD_SLIPS, "fourth": FOURTH_SLIPS, "fifth": FIFTH_SLIPS}


@functools.cache
def _judged() -> dict:
    """Each exercise's judged Answer, by its function's name (the audits' keys); the test modules imported as
    pytest imports them (one module object each: the ranks unpickle a body by its module's name)."""
    exercises = [importlib.import_module(p.stem).EXERCISE for p in sorted(HERE.glob("test_exercise[0-9][0-9]_*.py"))]
    return {exercise.name: exercise.judged() for exercise in exercises}


@pytest.mark.parametrize("audit", list(AUDITS))
def test_every_slip_of_the_audit_still_loads(audit):
    judged = _judged()
    for name, slip in AUDITS[audit].items():
        answer = judged[name]
        Planted(answer.path, answer.name, slip.old, slip.new, slip.what, slip.within).load()
