"""The comparison readout itself: it must see a difference when there is one."""

import pytest
import torch

from distlab.proof.compare import all_ok, compare, tolerances


def test_identical_tensors_pass_and_report_zero_error():
    ref = {"w": torch.randn(3, 4, dtype=torch.float64)}
    rows = compare(ref, {"w": ref["w"].clone()})
    assert all_ok(rows) and rows[0].max_abs == 0.0


def test_a_difference_beyond_tolerance_fails():
    ref = {"w": torch.ones(5, dtype=torch.float64)}
    act = {"w": ref["w"] + torch.tensor([0, 0, 1e-8, 0, 0], dtype=torch.float64)}
    rows = compare(ref, act)
    assert not all_ok(rows)
    assert rows[0].max_abs == pytest.approx(1e-8)


def test_shape_mismatch_fails_and_names_must_match():
    assert not all_ok(compare({"w": torch.zeros(2)}, {"w": torch.zeros(3)}))
    with pytest.raises(KeyError, match="only in reference"):
        compare({"a": torch.zeros(1)}, {"b": torch.zeros(1)})


def test_tolerances_are_stated_per_dtype():
    assert tolerances(torch.float64) == (1e-10, 1e-12)
    assert tolerances(torch.float32) == (1e-5, 1e-6)
    with pytest.raises(ValueError):
        tolerances(torch.int64)
