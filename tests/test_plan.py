"""The planner, `python -m distlab.plan`: for a fixed input its output is the same every time; every
configuration it prints fits the memory it claims, by the cost model, on every rank; the published runs
fit where they ran and their predicted MFU lands in the band the README states; bad input is refused in
one line naming the flag (exit 2), and an input nothing fits says so (exit 1)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import ROOT

from distlab.cost.hardware import DEVICES, GIB, cluster
from distlab.cost.step import step_cost
from distlab.cost.timing import Assumptions
from distlab.plan import report
from distlab.plan.cli import main
from distlab.plan.presets import MODELS
from distlab.plan.search import search
from distlab.proof.console import console

ARGS = ["--model", "llama3-8b", "--gpus", "16", "--nodes", "2", "--global-batch", "64", "--seq-len", "4096"]
BAND = (0.6, 1.3)  # predicted MFU / reported MFU: the band docs/results.md's lesson 13 results state


def printed(argv: list[str]) -> tuple[int, str]:
    with console.capture() as captured:
        code = main(argv)
    return code, captured.get()


def test_the_same_input_prints_the_same_plan(tmp_path):
    first, second = printed(ARGS), printed(ARGS)
    assert first == second and first[0] == 0
    assert "The 10 fastest of" in first[1] and "matrix products at 70% of the dense peak" in first[1]


def test_every_printed_configuration_fits_the_memory_it_claims(tmp_path):
    path = tmp_path / "plan.json"
    code, _ = printed([*ARGS, "--json", str(path), "--plot", str(tmp_path / "plan.png")])
    rows = json.loads(path.read_text())
    found = search(MODELS["llama3-8b"], 64, 4096, 16, cluster("h100"))
    assert code == 0 and len(rows) == len(found) > 10 and (tmp_path / "plan.png").stat().st_size > 10_000
    steps = [c.time.step for c in found]
    assert steps == sorted(steps)  # fastest first
    for row, candidate in zip(rows, found):
        again = step_cost(candidate.cost.model, candidate.cost.batch, candidate.parallel, "bf16", "cuda")
        assert again.peak_held == candidate.memory <= DEVICES["h100"].memory  # every rank, not only one
        assert row["memory_gib"] == candidate.memory / GIB and row["split"] == candidate.parallel.label()


def test_the_published_runs_fit_and_land_in_the_band():
    rows = report.published_rows(Assumptions())
    assert len(rows) == 5
    for row in rows:
        assert row["fits"], row
        assert BAND[0] <= row["ratio"] <= BAND[1], row


def test_the_datasheet_table_names_every_source():
    code, out = printed(["--devices"])
    flat = out.replace("\n", "")
    assert code == 0 and all(d.name in out for d in DEVICES.values())
    assert "resources.nvidia.com" in flat and "amd-instinct-mi300x-data-sheet" in flat


@pytest.mark.parametrize(
    "argv,words",
    [
        (["--gpus", "12", "--nodes", "8"], "--nodes: 12 GPUs do not spread evenly over 8 nodes"),
        (["--gpus", "32", "--nodes", "2"], "--nodes: 16 GPUs per node"),
        (["--layers", "4", "--dim", "64"], "--heads: a model of your own needs --layers, --dim, --heads"),
        (["--layers", "4", "--dim", "64", "--heads", "6", "--ffn-width", "256"], "--heads: h = 6 does not divide"),
        (["--vocab", "1000"], "--vocab: a vocabulary belongs to a model of your own"),
    ],
)
def test_impossible_input_is_refused_naming_the_flag(argv, words):
    with pytest.raises(ValueError) as err:
        main(argv)
    assert str(err.value).startswith(words) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    "argv,words",
    [(["--gpus", "0"], "argument --gpus: expected a positive integer, got '0'"), (["--gpu", "v100"], "invalid choice")],
)
def test_a_bad_value_is_refused_by_the_parser_in_one_line(argv, words, capsys):
    with pytest.raises(SystemExit) as done:
        main(argv)
    lines = capsys.readouterr().err.strip().splitlines()
    assert done.value.code == 2 and len(lines) == 1 and words in lines[0]


def test_the_command_prints_one_line_and_exits_2():
    """The whole path a user takes: `python -m distlab.plan` turns the ValueError into one line, exit 2."""
    done = subprocess.run(
        [sys.executable, "-m", "distlab.plan", "--gpus", "12", "--nodes", "8"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert done.returncode == 2 and lines == ["error: --nodes: 12 GPUs do not spread evenly over 8 nodes"]


def test_when_nothing_fits_it_says_so():
    code, out = printed(["--model", "llama3-405b", "--gpus", "8", "--global-batch", "8"])
    assert code == 1 and "nothing fits" in out


def test_the_planner_takes_no_lesson_memory_limit():
    """GPT-2 small's vocabulary (50,304) is above the lessons' --vocab limit (a width^2 float64 matrix a lesson
    would build); the planner builds no tensor, so its parser is `FlagParser` without the lessons' limits."""
    from distlab.plan.cli import parse_args
    from distlab.processes.cli import LIMITS

    flags = ["--layers", "12", "--dim", "768", "--heads", "12", "--ffn-width", "3072", "--vocab", "50304"]
    assert 50304 > LIMITS["--vocab"][0]  # a lesson would refuse it
    args = parse_args([*flags, "--gpu", "a100", "--gpus", "8", "--global-batch", "480", "--seq-len", "1024"])
    assert args.vocab == 50304 and args.global_batch == 480
