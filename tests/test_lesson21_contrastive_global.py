"""Lesson 21: global x global under DDP. The plain gather gives exactly 1/P of the full-batch
gradient; back-propagating P * L gives all of it (and so does lesson 23's sum-backward gather, checked
here on the same step). The lesson's own gather and losses equal the library's, bit for bit."""

import pytest
import torch
from helpers import (
    assert_flag_refused,
    assert_lesson_passes_at_80_columns,
    load_lesson,
    parse_lesson_args,
    torchrun,
)

from distlab.contrastive.reference import full_batch_gradients
from distlab.contrastive.step import first_step_gradients
from distlab.contrastive.variants import GLOBAL_PLAIN, GLOBAL_SUM, GLOBAL_TIMES_P
from distlab.processes.spawn import spawn
from distlab.proof.compare import all_ok, compare
from distlab.proof.models import TwoTower, paired_data

N, TAU, SEED = 12, 0.1, 4  # N = 12 splits over 1, 2, 3 and 4 ranks
VARIANTS = (GLOBAL_PLAIN, GLOBAL_TIMES_P, GLOBAL_SUM)


def _reference():
    return full_batch_gradients(TwoTower(seed=SEED), *paired_data(N, seed=SEED), 1 / TAU)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_global_x_global_gradients(world_size):
    per_rank = spawn(first_step_gradients, world_size, VARIANTS, N, TAU, seed=SEED)
    ref_loss, ref_grads = _reference()
    for results in per_rank:  # DDP leaves every rank with the same gradients: check each
        for name, (loss, _) in results.items():
            assert loss == pytest.approx(ref_loss, rel=1e-10, abs=1e-12), name
        plain = results[GLOBAL_PLAIN.name][1]
        # float64: rtol 1e-10, atol 1e-12
        assert all_ok(compare({n: g / world_size for n, g in ref_grads.items()}, plain))
        assert all_ok(compare(ref_grads, results[GLOBAL_TIMES_P.name][1]))
        assert all_ok(compare(ref_grads, results[GLOBAL_SUM.name][1]))
        # The check can fail: with more than one rank the plain gather is not the full gradient.
        assert all_ok(compare(ref_grads, plain)) == (world_size == 1)


def _the_lessons_own(rt):
    """The lesson's variants, the check that they equal the library's (bit for bit), and the same check
    against a variant that is not their twin (the sum-backward gather: exact, so not the same numbers)."""
    lesson = load_lesson("contrastive_global")
    ours = first_step_gradients(rt, lesson.VARIANTS, N, TAU, seed=SEED)
    wrong_twin = {lesson.GLOBAL_PLAIN.name: GLOBAL_SUM}
    return (
        ours,
        lesson.same_as_library(rt, ours, N, TAU, SEED, torch.float64),
        lesson.same_as_library(rt, ours, N, TAU, SEED, torch.float64, twins=wrong_twin),
    )


@pytest.mark.parametrize("world_size", [1, 3])
def test_the_lessons_gather_and_fix_equal_the_librarys(world_size):
    ref_loss, ref_grads = _reference()
    for ours, same, same_as_another in spawn(_the_lessons_own, world_size):
        (loss, plain), (fixed_loss, fixed) = ours["plain"], ours["plain, P L"]
        assert loss == pytest.approx(ref_loss, rel=1e-10) and fixed_loss == loss
        assert all_ok(compare({n: g / world_size for n, g in ref_grads.items()}, plain))
        assert all_ok(compare(ref_grads, fixed))
        assert same
        assert same_as_another == (world_size == 1)  # at P = 1 every gather is the identity


LESSON = "contrastive_global"


def test_the_lesson_passes_and_reads_whole_at_80_columns():
    assert_lesson_passes_at_80_columns(LESSON, 2, "--global-batch", "48")


def test_p_must_divide_n_is_one_line_naming_the_flag():
    run = torchrun(LESSON, 3, "--global-batch", "10")
    errors = [line for line in run.stdout.splitlines() if line.startswith("error:")]
    assert run.returncode != 0 and errors == ["error: --global-batch: P = 3 ranks must divide N = 10"], run.stdout
    assert run.stdout.splitlines()[0] == errors[0], run.stdout  # checked before the lesson prints anything


@pytest.mark.parametrize(
    "flag, value",
    [("--global-batch", "0"), ("--global-batch", "abc"), ("--tau", "nan"), ("--tau", "-1"), ("--dtype", "float16")],
)
def test_bad_flags_are_refused_before_any_process_group(flag, value):
    assert_flag_refused(LESSON, flag, flag, value)


def test_help_shows_the_defaults():
    code, _, out, _ = parse_lesson_args(LESSON, "--help")
    assert code == 0 and "(default: 384)" in out
