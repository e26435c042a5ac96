"""distlab.processes.reproducible: float32 stated, not inherited; deterministic kernels on CUDA; both undone after.

No GPU here: the switches are torch's global flags and an environment variable, set and restored the same
way whether or not a GPU reads them (the GPU check runs lessons 07 and 27 with them on a GPU)."""

from __future__ import annotations

import os

import pytest
import torch

from distlab.processes.reproducible import CUBLAS_WORKSPACE, deterministic, exact_float32

CUDA, CPU = torch.device("cuda", 0), torch.device("cpu")


def _flags() -> tuple:
    return (
        torch.are_deterministic_algorithms_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
        os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
    )


def test_exact_float32_turns_tf32_off_and_gives_the_callers_settings_back():
    assert torch.backends.cudnn.allow_tf32  # torch's default for convolutions
    torch.backends.cuda.matmul.allow_tf32 = True  # open_clip's training script does this
    try:
        with exact_float32():
            assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32 = False


def test_deterministic_on_cuda_sets_every_switch_and_undoes_them(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = _flags()
    with deterministic(CUDA):
        assert _flags() == (True, True, False, CUBLAS_WORKSPACE)
        assert torch.is_deterministic_algorithms_warn_only_enabled()
    assert _flags() == before
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")  # a caller's own choice stays
    with deterministic(CUDA):
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"


def test_deterministic_on_the_cpu_changes_nothing():
    before = _flags()
    with deterministic(CPU):
        assert _flags() == before


def test_deterministic_is_undone_when_the_block_raises():
    before = _flags()
    with pytest.raises(RuntimeError), deterministic(CUDA):
        raise RuntimeError("a failing lesson")
    assert _flags() == before
