"""Every read-along notebook runs top to bottom, so none can rot."""

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).parent.parent / "lessons" / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks():
    assert NOTEBOOKS, "lessons/notebooks/ holds no notebook"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes(path):
    notebook = nbformat.read(path, as_version=4)
    # Executed in memory, from the notebook's own folder (the notebooks call ../NN_lesson.py);
    # the committed file keeps the outputs of the real run it was saved with.
    NotebookClient(notebook, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()
