"""benchmarks/gpu_check.sh keeps its Python in .py files that ruff and the tests read: no Python heredoc in the
script, every benchmarks/*.py it runs exists, and its environment questions (gpu_check_env.py) answer here as the
script reads them. (The check itself runs with `bash benchmarks/gpu_check.sh --cpu-dry-run`, 5-7 minutes.)"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys

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
