"""The shared lesson machinery: flags refused in one line naming the flag, output laid out for the
width it really has, and a verdict every rank agrees on."""

import argparse
import json
import subprocess
import sys

import pytest

from distlab.processes.console import CAPTURED_WIDTH, column_blocks
from distlab.processes.flags import (
    check_flags_against_world,
    divides_global_batch,
    fraction,
    png_file,
    positive_float,
    positive_int,
    share,
)
from distlab.processes.spawn import spawn
from distlab.proof.cli import add_mlp_args, lesson_parser
from distlab.proof.verdict import Verdict


@pytest.mark.parametrize(
    "flag, value",
    [
        ("--width", "0"),
        ("--width", "-3"),
        ("--width", "abc"),
        ("--lr", "nan"),
        ("--lr", "inf"),
        ("--lr", "0"),
        ("--steps", "1.5"),
    ],
)
def test_bad_flag_is_one_line_naming_the_flag(flag, value, capsys):
    parser = add_mlp_args(lesson_parser("Lesson"), 8, 256, 512, 5)
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args([flag, value])
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and f"argument {flag}:" in lines[0] and repr(value) in lines[0], lines


def test_argument_types_accept_good_values():
    assert positive_int("3") == 3 and positive_float("0.5") == 0.5 and fraction("0") == 0.0
    with pytest.raises(argparse.ArgumentTypeError):
        fraction("1")
    assert share("1") == 1.0 and share("0.5") == 0.5  # a share of a peak: the peak itself allowed
    for bad in ("0", "1.5", "nan"):
        with pytest.raises(argparse.ArgumentTypeError, match="a share 0 < x <= 1"):
            share(bad)


def test_a_plot_is_a_png_file_that_can_be_written(tmp_path):
    assert png_file(str(tmp_path / "plan.PNG")) == str(tmp_path / "plan.PNG")
    with pytest.raises(argparse.ArgumentTypeError, match="give a name ending in .png"):
        png_file(str(tmp_path / "plan.txt"))
    with pytest.raises(argparse.ArgumentTypeError, match="does not exist"):
        png_file(str(tmp_path / "missing" / "plan.png"))


def test_help_shows_defaults():
    text = add_mlp_args(lesson_parser("Lesson X: a title.\n\nMore."), 8, 256, 512, 5).format_help()
    assert "(default: 256)" in text and "Lesson X: a title." in text and "More." not in text


def test_help_and_errors_are_printed_by_rank_0_only(monkeypatch, capsys):
    # Under torchrun every rank parses the flags: only rank 0 speaks, every rank exits alike.
    for rank, speaks in (("1", False), ("0", True)):
        monkeypatch.setenv("RANK", rank)
        for argv in (["--help"], ["--seed", "-1"]):
            with pytest.raises(SystemExit):
                add_mlp_args(lesson_parser("doc"), 2, 4, 8, 1).parse_args(argv)
            out, err = capsys.readouterr()
            assert bool(out + err) == speaks, (rank, argv, out, err)


def test_flags_are_checked_against_p_before_any_group(monkeypatch):
    args = add_mlp_args(lesson_parser("doc"), 2, 4, 10, 1).parse_args([])
    monkeypatch.setenv("WORLD_SIZE", "3")  # torchrun's announcement of P, read before any process group
    with pytest.raises(ValueError, match="^--global-batch: P = 3 ranks must divide N = 10$"):
        check_flags_against_world(args, divides_global_batch)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert check_flags_against_world(args, divides_global_batch) is args
    monkeypatch.delenv("WORLD_SIZE")  # not under torchrun: nothing to check against yet
    assert check_flags_against_world(args, lambda a, p: pytest.fail("no P, no rules")) is args


def test_captured_output_gets_the_generous_width_whatever_force_color_says():
    code = "from distlab.processes.console import console; print(console.width)"
    env = {"FORCE_COLOR": "1", "PATH": "", "PYTHONPATH": ":".join(sys.path)}
    width = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env).stdout
    assert int(width) == CAPTURED_WIDTH
    env["COLUMNS"] = "80"
    assert int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env).stdout) == 80


def test_wide_grids_fold_into_blocks_that_fit():
    blocks = column_blocks(columns=20, cell_width=4, label_width=8, width=40)
    assert [list(b) for b in blocks] == [list(range(0, 8)), list(range(8, 16)), list(range(16, 20))]


def _verdict(rt, fail_on_rank, path):
    verdict = Verdict(rt)
    verdict.check("always", True)
    verdict.check("fails on one rank", rt.rank != fail_on_rank, "detail")
    verdict.figure("x", 1.5)
    return verdict.finish(path)


def test_a_claim_failing_on_one_rank_fails_everywhere(tmp_path):
    path = str(tmp_path / "v.json")
    assert spawn(_verdict, 2, 1, path) == [1, 1]
    report = json.loads(open(path).read())
    assert [c["ok"] for c in report["checks"]] == [True, False] and report["figures"] == {"x": 1.5}
    assert spawn(_verdict, 2, -1, None) == [0, 0]


def test_an_input_width_the_mlp_cannot_take_names_its_flag():
    import argparse

    from distlab.proof.cli import check_mlp_input

    with pytest.raises(ValueError, match=r"^--input-features: a batch of shape \(N, 5\) does not fit"):
        check_mlp_input(argparse.Namespace(input_features=5))
    check_mlp_input(argparse.Namespace(input_features=16), world_size=3)  # fits: no error, whatever P
