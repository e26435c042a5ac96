"""Lesson 12: one transformer on a dp x pp x tp x cp mesh equals one process training the same model on the
same global batch (float64, 1e-10: every step's loss, every parameter, step 1's gradients, every AdamW
state), at each dimension alone (P = 2, here) and in pairs (P = 4, test_lesson12_composed_mesh_pairs.py),
and at P = 8 with all of them (test_lesson12_composed_mesh_p8.py); bytes, model states and activations per
rank equal their closed forms; a bad shape is one line naming its flag, before any process group.

The reference is independent: `lesson.reference` trains a fresh whole `LanguageModel` in one process with
plain autograd and torch's AdamW (`distlab.proof.reference.one_process`), nothing of the mesh's code on its path."""

from __future__ import annotations

from argparse import Namespace
from dataclasses import replace

from composed_helpers import CFG, LESSON, assert_every_shape_equals_one_process, shapes_against_one_process
from helpers import load_lesson, torchrun, value_error

from distlab.composed.config import small_shapes
from distlab.composed.dims import ParallelDims
from distlab.processes.spawn import spawn
from distlab.proof.compare import all_ok


def test_each_dimension_alone_at_p2_equals_one_process():
    shapes = small_shapes(2)
    assert [str(s) for s in shapes] == ["2x1x1x1", "1x2x1x1", "1x1x2x1", "1x1x1x2"]
    assert_every_shape_equals_one_process(spawn(shapes_against_one_process, 2, shapes, CFG), shapes, CFG)


def _a_wrong_model(rt) -> list[dict]:
    """A wrong answer the checks must reject: the mesh trains at a learning rate one part in 1e6 off."""
    lesson = load_lesson(LESSON)
    ref = lesson.reference(CFG)
    one = lesson.train_shape(rt, replace(CFG, lr=CFG.lr * (1 + 1e-6)), ParallelDims(dp=2))
    return [{k: all_ok(v) for k, v in lesson.against(ref, one.run).items()}]


def test_the_comparison_can_fail():
    for found in spawn(_a_wrong_model, 2):
        assert found[0] == {"params": False, "grads": True, "states": False}  # step 1's gradients precede it


def _args(**flags) -> Namespace:
    defaults = dict(dp=2, pp=2, tp=2, cp=1, shapes="", resume_shape=None, global_batch=8, micro_batches=2)
    defaults |= dict(seq_len=16, layers=4, dim=32, heads=4, ffn_width=64, vocab=32, steps=3, lr=1e-2, seed=0)
    return Namespace(**(defaults | flags))


def test_bad_shapes_are_refused_naming_the_flag_before_any_process_group():
    rules = load_lesson(LESSON).world_rules
    assert value_error(rules, _args(), 8) is None
    cases = {
        "--dp, --pp, --tp, --cp:": _args(dp=4),  # 4 x 2 x 2 x 1 = 16, P = 8
        "--pp:": _args(layers=3),
        "--tp:": _args(heads=3, dim=33),
        "--cp:": _args(dp=1, cp=2, seq_len=10),  # 10 positions do not cut into 2 cp = 4 zig-zag pieces
        "--micro-batches:": _args(pp=4, dp=1),
        "--shapes:": _args(shapes="2x2x2x1,1x1x3x1"),
        "--resume-shape:": _args(resume_shape="8x1x1x1", global_batch=4),
        "--dim:": _args(dim=30),
        "--steps:": _args(steps=1),
    }
    for flag, args in cases.items():
        message = value_error(rules, args, 8)
        assert message is not None and message.startswith(flag) and "\n" not in message, (flag, message)


def test_a_bad_shape_under_torchrun_is_one_line_before_any_output():
    run = torchrun(f"{LESSON}.py", 1, timeout=120)  # the default 2 x 2 x 2 x 1 on one rank
    errors = [line for line in run.stdout.splitlines() if line.startswith("error:")]
    assert run.returncode != 0, run.stdout
    assert errors == ["error: --dp, --pp, --tp, --cp: dp x pp x tp x cp = 8 ranks, but P = 1"], run.stdout
    assert run.stdout.splitlines()[0] == errors[0], run.stdout  # checked before the lesson prints anything
