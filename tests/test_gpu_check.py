"""benchmarks/gpu_check.sh keeps its Python in .py files that ruff and the tests read: no Python heredoc in the
script, every benchmarks/*.py it runs exists, and its environment questions (gpu_check_env.py) answer here as the
script reads them. (The check itself runs with `bash benchmarks/gpu_check.sh --cpu-dry-run`, 5-7 minutes.)"""

from __future__ import annotations

import importlib.util
import json
import re
import runpy
import subprocess
import sys

import pytest
import torch
from helpers import ROOT

SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
HEREDOC = re.compile(r"<<-?\s*'?(PY|PYEOF|EOF)'?|\bpython3?\s+-\s*<<|\"\$PY\"\s+-\s")
RUNS = re.compile(r"\$REPO/(benchmarks/[\w/]+\.py)|\b(benchmarks/[\w/]+\.py)")


def python_heredocs(text: str) -> list[str]:
    return [line for line in text.splitlines() if HEREDOC.search(line)]


def test_the_script_holds_no_python_and_runs_files_that_exist():
    text = SCRIPT.read_text()
    assert python_heredocs(text) == []
    named = {a or b for a, b in RUNS.findall(text)}
    assert {"benchmarks/gpu_check_env.py", "benchmarks/gpu_check_equiv.py", "benchmarks/gpu_check_timing.py"} <= named
    assert all((ROOT / name).is_file() for name in named), sorted(n for n in named if not (ROOT / n).is_file())


def test_a_heredoc_is_found():
    assert python_heredocs("probe() { \"$PY\" - <<'PY' 2>/dev/null\nimport torch\nPY\n}")
    assert python_heredocs("cat > \"$HELP/x.py\" <<'PYEOF'")
    assert not python_heredocs('probe() { "$PY" "$REPO/benchmarks/gpu_check_env.py" probe 2>/dev/null; }')


def ask(question: str) -> str:
    env_py = ROOT / "benchmarks" / "gpu_check_env.py"
    run = subprocess.run([sys.executable, str(env_py), question], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    return run.stdout.rstrip("\n")


def test_the_environment_questions_answer_as_the_script_reads_them():
    version, cuda, available, count = ask("probe").split()  # `read -r TV TCUDA TAVAIL TCOUNT`
    assert version == torch.__version__ and available == str(torch.cuda.is_available())
    assert int(count) == torch.cuda.device_count() and cuda == str(torch.version.cuda)
    assert ask("missing") == ""  # the pinned stack has every package the check needs
    assert ask("api") == ""  # and torch 2.13 every name the project calls


def test_the_equivalence_cases_are_one_base_and_their_changes():
    """gpu_check_equiv.py's CASES are `case(name, **changes)` over one BASE: each differs from it only where its
    name says, is allowed its dtype's tolerance, and is named once (the records key on the names)."""
    spec = importlib.util.spec_from_file_location("gpu_check_equiv", ROOT / "benchmarks" / "gpu_check_equiv.py")
    equiv = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(equiv)
    names = [each["name"] for each in equiv.CASES]
    assert len(names) == len(set(names)) == 10
    for each in equiv.CASES:
        assert set(equiv.BASE) <= set(each) and each["tol"] == equiv.TOLERANCES[each["dtype"]], each
    ring = equiv.case("ring", exchange="ring", dtype="float32")
    assert ring == equiv.BASE | {"exchange": "ring", "dtype": "float32", "name": "ring", "tol": 1e-4}
    assert equiv.case("x", **equiv.WHOLE)["b"] == equiv.N  # B = C: one micro-batch a rank at any P


NEXT = ROOT / "benchmarks" / "gpu_next.sh"


def test_the_next_run_holds_no_python_and_runs_what_exists():
    text = NEXT.read_text()
    assert python_heredocs(text) == []
    named = set(re.findall(r"\b((?:benchmarks|lessons)/[\w/]+\.py)", text))
    assert {"benchmarks/gpu_next.py", "benchmarks/clip_batch.py", "lessons/13_cost.py"} <= named
    assert all((ROOT / name).is_file() for name in named), sorted(n for n in named if not (ROOT / n).is_file())
    assert "--n-max 3840" in text and "--emulate-ms" in text


def test_the_next_runs_dry_run_passes(tmp_path):
    """benchmarks/gpu_next.py --cpu-dry-run (the script's step 1; the whole script's dry run also trains the tiny
    ViT stand-in and runs lessons 05 and 13 on the CPU, a few minutes): every row exact, timed and searched once,
    under the interpreter, S in memory among them, each path's row with its modelled floor; the tile cache stays
    where the script points it, on a CPU nowhere."""
    import os

    env = os.environ | {"TRITON_INTERPRET": "1", "DISTLAB_KERNEL_CACHE": str(tmp_path / "cache" / "tiles.json")}
    script = ROOT / "benchmarks" / "gpu_next.py"
    run = subprocess.run(
        [sys.executable, str(script), str(tmp_path), "--cpu-dry-run"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_next.json").read_text())
    assert report["exact"] and all(row["ok"] for row in report["exact"]) and not report["skipped"]
    assert {"InfoNCE ring, defaults", "P = 1 InfoNCE ring", "visit fold 128x128x64"} <= set(report["timing"])
    s_rows = {"InfoNCE ring, S in memory", "sigmoid ring, S in memory", "P = 1 InfoNCE ring, S in memory"}
    assert s_rows <= set(report["timing"]) and all(report["timing"][name]["floor"] > 0 for name in s_rows)
    assert {row["kernels"] for row in report["exact"]} >= {"triton", "triton-mm", "triton-s"}
    assert {row["kind"] for row in report["search"]} == {"fold", "ring-fold", "infonce-mm", "sigmoid-mm"}
    assert not (tmp_path / "cache").exists()


LESSONS = sorted((ROOT / "lessons").glob("[0-9][0-9]_*.py"))


def gpu_check_env():
    spec = importlib.util.spec_from_file_location("gpu_check_env", ROOT / "benchmarks" / "gpu_check_env.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: --device cuda would run")
@pytest.mark.parametrize("lesson", LESSONS, ids=[p.stem for p in LESSONS])
def test_step_c_runs_every_lesson_at_p_1_on_the_gpu_or_says_why_not(lesson, monkeypatch, capsys):
    """gpu_check.sh's step (c) asks gpu_check_env.py how to run each lesson; every lesson it runs on the GPU at
    P = 1 takes that P and those flags: given them with --device cuda here, where there is no GPU, it gets as far
    as asking for the GPU (the one error line names --device, never a flag or the rank count). Those it moves to
    the CPU at P = 2 (one GPU holds one rank) refuse P = 1 naming the rank count: the reason is real."""
    env = gpu_check_env()
    world, device, *flags = env.lesson(f"lessons/{lesson.name}", "cuda").split()
    moved = device == "cpu"
    for name, value in ("RANK", 0), ("WORLD_SIZE", 1), ("LOCAL_RANK", 0), ("LOCAL_WORLD_SIZE", 1):
        monkeypatch.setenv(name, str(value))
    for name in ("MASTER_ADDR", "MASTER_PORT", "DISTLAB_STRICT_DEVICE", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(sys, "argv", [str(lesson), "--device", "cuda", *flags])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(lesson), run_name="__main__")
    text = "".join(capsys.readouterr())
    errors = [line for line in text.splitlines() if "error" in line.lower()]
    assert exit_.value.code == 2 and len(errors) == 1 and "Traceback" not in text, text
    expected = "--nproc-per-node" if moved else "--device cuda needs one GPU per rank"
    assert expected in errors[0] and (world, moved) in (("1", False), ("2", True)), errors[0]


def test_the_clip_batch_dry_run_trains_every_batch_and_sweeps_the_ring(tmp_path):
    """benchmarks/clip_batch.py --cpu-dry-run at N_max = 8 (the tiny stand-in; the GPU run trains ViT-B-32 at
    open_clip's N_max, 4x and 16x it): both methods at N_max, distlab's step at 4x and 16x with the time per pair
    against the recipe's, then the ring at fixed N for P = 1, 2, 4, 8, whose memory per rank falls with P."""
    import os

    script = ROOT / "benchmarks" / "clip_batch.py"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", str(script)]
    command += [str(tmp_path), "--cpu-dry-run", "--n-max", "8", "--micro-batch", "16"]
    env = os.environ | {"PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads((tmp_path / "clip_batch.json").read_text())
    trained = {(row["factor"], row["method"]) for row in report["rows"] if not row["oom"]}
    assert {(1, "open_clip recipe"), (1, "distlab step"), (4, "distlab step"), (16, "distlab step")} <= trained
    sweep = report["sweep"]
    assert [row["world"] for row in sweep] == [1, 2, 4, 8]
    assert all(a["peak_bytes"] > b["peak_bytes"] for a, b in zip(sweep, sweep[1:]))  # memory per rank falls with P
    assert "time per pair" in (tmp_path / "clip_batch.md").read_text()
