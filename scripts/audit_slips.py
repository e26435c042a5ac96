"""The judge's audit: each exercise's planted slip (tests/exercise_slips.py) judged alone, one row per exercise:
caught or not, whether the first hint (level 1) names the slip by its `names` words, and that first hint.

    PYTHONPATH=src python scripts/audit_slips.py            # every exercise (one spawn or two each)
    PYTHONPATH=src python scripts/audit_slips.py 03 20      # some
    PYTHONPATH=src python scripts/audit_slips.py --second   # the second audit's slips (tests/exercise_new_slips.py)
    PYTHONPATH=src python scripts/audit_slips.py --third 01 # the third audit's (tests/exercise_third_slips.py)
    PYTHONPATH=src python scripts/audit_slips.py --fourth   # the fourth audit's (tests/exercise_fourth_slips.py)
    PYTHONPATH=src python scripts/audit_slips.py --fifth    # the fifth audit's (tests/exercise_fifth_slips.py)

The same slips are asserted by each exercise's `test_the_judge_rejects_a_planted_slip`; this prints what a learner
would read, for the table in lessons/exercises/README.md."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))


def _exercise(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module  # the ranks unpickle its body by this name
    spec.loader.exec_module(module)
    return module.EXERCISE


def main(numbers: list[str]) -> None:
    from exercise_fifth_slips import FIFTH_SLIPS
    from exercise_fourth_slips import FOURTH_SLIPS
    from exercise_new_slips import NEW_SLIPS
    from exercise_slips import SLIPS, Planted
    from exercise_third_slips import THIRD_SLIPS

    audits = {"--second": NEW_SLIPS, "--third": THIRD_SLIPS, "--fourth": FOURTH_SLIPS, "--fifth": FIFTH_SLIPS}
    slips = next((audits[n] for n in numbers if n in audits), SLIPS)
    numbers = [n for n in numbers if n not in audits]

    for path in sorted((ROOT / "tests").glob("test_exercise[0-9][0-9]_*.py")):
        number = path.stem[len("test_exercise") :][:2]
        if numbers and number not in numbers:
            continue
        exercise = _exercise(path)
        if exercise.name not in slips:  # the third audit covers some exercises only
            continue
        slip, judged = slips[exercise.name], exercise.judged()
        planted = Planted(judged.path, judged.name, slip.old, slip.new, slip.what, slip.within)  # as planted() does
        (verdict,) = exercise.judge([planted])
        text = exercise.message(verdict, 1)
        caught = text is not None
        named = caught and bool(slip.names) and re.search(slip.names, text) is not None
        print(f"| {number} | {slip.what} | {'yes' if caught else 'no'} | {'yes' if named else '?'} |", flush=True)
        print("\n".join(f"    {line}" for line in (text or "(every claim held)").splitlines()), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
