"""Suite-wide settings."""

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread, as torchrun and spawn give each rank: on a small shared CPU, two threads
    per op mostly wait for each other (the memory test runs 25x slower with them)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
