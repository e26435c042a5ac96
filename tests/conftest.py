"""Suite-wide settings, and `pytest --exercises`: judge the learner's answers in lessons/exercises/."""

import pytest
import torch


def pytest_addoption(parser):
    parser.addoption(
        "--exercises",
        action="store_true",
        help="run only the exercise tests, on your answers in lessons/exercises/ (add -k NN for one)",
    )


def pytest_configure(config):
    config.addinivalue_line("markers", "exercise: judges a lesson's exercise (the solution, or yours with --exercises)")


def pytest_collection_modifyitems(config, items):
    """With --exercises, only the exercise tests run (on the learner's files); without, everything runs
    and the exercise tests judge the lessons' own solutions."""
    if config.getoption("--exercises"):
        kept = [item for item in items if item.get_closest_marker("exercise")]
        config.hook.pytest_deselected(items=[item for item in items if item not in kept])
        items[:] = kept


@pytest.fixture
def source(request) -> str:
    """Whose function an exercise test judges: "exercise" (yours, with --exercises) or "solution"."""
    return "exercise" if request.config.getoption("--exercises") else "solution"


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread, as torchrun and spawn give each rank: on a small shared CPU, two threads
    per op mostly wait for each other (the memory test runs 25x slower with them)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
