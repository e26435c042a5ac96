"""Every numeric flag of every lesson, fed its extremes in this process (each lesson's own `parse_args()`,
no torchrun, no process group): a value that would overflow or could not fit in memory is refused in one
line naming the flag, exit 2, before anything runs. And `--json` / `--checkpoint-dir` paths that could not
be written are refused the same way, not after the run (or at its first save)."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import LESSONS, parse_lesson_args

from distlab.proof.cli import LIMITS

LESSON_FILES = sorted(p.name for p in LESSONS.glob("[0-9][0-9]_*.py"))
HUGE = {int: str(10**30), float: "1e300"}  # past any int64 and past any limit; both finite


def numeric_flags(lesson: str) -> dict[str, type]:
    """The lesson's numeric flags (those whose default parses to a number), with their type."""
    code, args, _, err = parse_lesson_args(lesson)
    assert code is None, err
    return {
        "--" + dest.replace("_", "-"): type(value)
        for dest, value in vars(args).items()
        if isinstance(value, (int, float)) and not isinstance(value, bool)
    }


def refused_in_one_line(lesson: str, flag: str, value: str) -> str | None:
    """None when `lesson` refuses `flag value` as it should; else what happened."""
    code, _, _, err = parse_lesson_args(lesson, flag, value)
    lines = err.strip().splitlines()
    if code == 2 and len(lines) == 1 and f"argument {flag}:" in lines[0]:
        return None
    return f"{lesson} {flag} {value}: exit {code}, {lines}"


@pytest.mark.parametrize("lesson", LESSON_FILES)
def test_every_numeric_flag_at_its_extremes_is_refused_naming_it(lesson):
    flags = numeric_flags(lesson)
    assert flags, lesson
    wrong = []
    for flag, kind in flags.items():
        values = [HUGE[kind], "-1", "nan"] + ([str(LIMITS[flag][0] + 1)] if flag in LIMITS else [])
        wrong += [w for value in values if (w := refused_in_one_line(lesson, flag, value))]
    assert not wrong, wrong


def accepted(lesson: str, *args: str) -> bool:
    return parse_lesson_args(lesson, *args)[0] is None


def test_a_flag_at_its_limit_is_accepted_one_past_it_refused():
    for flag, value in (("--seed", LIMITS["--seed"][0]), ("--global-batch", 2**20), ("--steps", 10**6)):
        assert accepted("06_data_parallel.py", flag, str(value)), flag
        assert refused_in_one_line("06_data_parallel.py", flag, str(value + 1)) is None, flag


@pytest.mark.parametrize(
    "make, why",
    [
        (lambda tmp: tmp, "is a directory"),
        (lambda tmp: tmp / "missing" / "out.json", "does not exist"),
    ],
)
def test_a_json_path_that_cannot_be_written_is_refused_before_the_run(tmp_path: Path, make, why):
    code, _, _, err = parse_lesson_args("06_data_parallel.py", "--json", str(make(tmp_path)))
    assert code == 2 and "argument --json:" in err and why in err, err
    assert accepted("06_data_parallel.py", "--json", str(tmp_path / "out.json"))


@pytest.mark.parametrize("lesson", ["07_sharding.py", "12_composed_mesh.py", "27_train_clip.py"])
def test_a_checkpoint_dir_that_is_a_file_is_refused_before_the_run(tmp_path: Path, lesson):
    (tmp_path / "file").write_text("")
    code, _, _, err = parse_lesson_args(lesson, "--checkpoint-dir", str(tmp_path / "file" / "sub"))
    assert code == 2 and "argument --checkpoint-dir:" in err and "not a directory" in err, err
    code, _, _, err = parse_lesson_args(lesson, "--checkpoint-dir", str(tmp_path / "file"))
    assert code == 2 and "argument --checkpoint-dir:" in err and "not a directory" in err, err
    assert accepted(lesson, "--checkpoint-dir", str(tmp_path / "new" / "dir"))
