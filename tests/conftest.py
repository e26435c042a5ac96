"""Suite-wide settings, and `pytest --exercises`: judge the learner's answers in lessons/exercises/.

With --exercises only the exercise test files are collected (`-k NN` narrows that to exercise NN's file
before anything is imported), the judge prints hints up to --hint-level (or DISTLAB_HINT_LEVEL; 0 for no
help, 1 by default) and the summary says how long each check took."""

import os
import re

# Triton chooses between compiling and interpreting when it decorates a function, its own `tl.zeros` and
# friends included, that is when triton is first imported; collecting any test module that imports
# `distributed_clip` imports it (through torch.compile's modules). So the kernel tests' interpreter is turned
# on here, before anything is collected. It changes nothing else: KERNELS "auto" picks the torch tiles for
# CPU tensors, and the test that checks the refusal without the interpreter starts its own process.
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_addoption(parser):
    parser.addoption(
        "--exercises",
        action="store_true",
        help="run only the exercise tests, on your answers in lessons/exercises/ (add -k NN for one)",
    )
    parser.addoption(
        "--hint-level",
        type=int,
        default=None,
        help="how much help a failed exercise prints: 0 none, 1 the idea, 2 the step, 3 nearly the line "
        "(default: DISTLAB_HINT_LEVEL, else 1)",
    )


def pytest_configure(config):
    config.addinivalue_line("markers", "exercise: judges a lesson's exercise (the solution, or yours with --exercises)")


def _exercise_number(config) -> str | None:
    """The NN of `-k NN` (or `-k 6`), when that is all the keyword expression says."""
    keyword = (config.getoption("keyword") or "").strip()
    return f"{int(keyword):02d}" if re.fullmatch(r"\d{1,2}", keyword) else None


def pytest_ignore_collect(collection_path, config):
    """With --exercises, no file but the exercise tests is even imported (and only NN's with -k NN)."""
    if not config.getoption("--exercises") or collection_path.suffix != ".py":
        return None
    name, number = collection_path.name, _exercise_number(config)
    if not name.startswith("test_"):
        return None
    if not name.startswith("test_exercise") or (number and not name.startswith(f"test_exercise{number}_")):
        return True
    return None


def pytest_collection_modifyitems(config, items):
    """With --exercises, only the exercise tests run (on the learner's files); without, everything runs
    and the exercise tests judge the lessons' own solutions."""
    if config.getoption("--exercises"):
        kept = [item for item in items if item.get_closest_marker("exercise")]
        config.hook.pytest_deselected(items=[item for item in items if item not in kept])
        items[:] = kept


def pytest_terminal_summary(terminalreporter, config):
    if not config.getoption("--exercises"):
        return
    from exercise_kit import TIMES

    for lesson, passed, seconds in config.stash.get(TIMES, []):
        terminalreporter.write_line(
            f"exercise {lesson}: {'passed' if passed else 'failed'}, checked in {seconds:.1f} s"
        )


@pytest.fixture
def source(request) -> str:
    """Whose function an exercise test judges: "exercise" (yours, with --exercises) or "solution"."""
    return "exercise" if request.config.getoption("--exercises") else "solution"


@pytest.fixture
def hint_level(request) -> int:
    """How many levels of hints a failed exercise prints."""
    from exercise_kit import hint_level_default

    level = request.config.getoption("--hint-level")
    return hint_level_default() if level is None else level


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread, as torchrun and spawn give each rank: on a small shared CPU, two threads
    per op mostly wait for each other (the memory test runs 25x slower with them)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
