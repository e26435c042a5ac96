"""`exercise_trace`: the lesson's function shadowing an answer's finds where the answer first departs, by the
operation and the name, in words that point at the slip; a right answer written the lesson's way departs
nowhere; the lesson's run leaves the caller's arguments and random state as they were."""

from pathlib import Path

import torch
from exercise_trace import Shadow

HERE = str(Path(__file__))


def lesson(x, w):
    total = torch.zeros(w.shape[1], dtype=x.dtype)
    for row in x:
        total += row @ w
    loss = total.sum() / len(x)
    loss.backward()
    return loss.detach()


def factor(x, w):  # the loss not divided by the rows
    total = torch.zeros(w.shape[1], dtype=x.dtype)
    for row in x:
        total += row @ w
    loss = total.sum() / 1
    loss.backward()
    return loss.detach()


def assigned(x, w):  # each row's term assigned, not accumulated
    total = torch.zeros(w.shape[1], dtype=x.dtype)
    for row in x:
        total = row @ w
    loss = total.sum() / len(x)
    loss.backward()
    return loss.detach()


def mean(x, w):  # another reduction: an operation the lesson never runs
    total = torch.zeros(w.shape[1], dtype=x.dtype)
    for row in x:
        total += row @ w
    loss = total.mean() / len(x)
    loss.backward()
    return loss.detach()


def _departs(answer) -> str:
    """What the shadow finds for `answer`, named like the lesson's function (as an exercise's blank is)."""
    answer.__code__ = answer.__code__.replace(co_name="lesson")
    shadow = Shadow(lesson, Path(HERE), Path(HERE), agree=lambda ok: ok)
    x, w = torch.randn(4, 3, dtype=torch.float64), torch.randn(3, 2, dtype=torch.float64, requires_grad=True)
    shadow.wrap(answer)(x, w)
    return shadow.departs


def test_a_right_answer_departs_nowhere_and_the_caller_keeps_its_state():
    x, w = torch.randn(4, 3, dtype=torch.float64), torch.randn(3, 2, dtype=torch.float64, requires_grad=True)
    shadow = Shadow(lesson, Path(HERE), Path(HERE), agree=lambda ok: ok)
    state = torch.get_rng_state()
    shadow.wrap(lesson)(x, w)
    assert shadow.departs == ""
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.allclose(
        w.grad, x.sum(0)[:, None].expand(3, 2) / 4
    )  # one backward's worth: the lesson's ran on a copy


def test_a_factor_is_told_at_the_statement_that_made_it():
    said = _departs(factor)
    assert "the first operation: line 26 (loss = total.sum() / 1): its div.Tensor gives other values" in said, said
    assert "`loss`" in said and "(loss = total.sum() / 1)" in said and "4 times the lesson's" in said, said


def test_an_assignment_where_the_lesson_accumulates_is_named():
    said = _departs(assigned)
    assert "total = row @ w" in said and "only what this statement adds this time" in said, said


def test_another_operation_is_named_by_its_op():
    said = _departs(mean)
    assert "the first operation: line" in said and "runs mean" in said and "the lesson's runs sum" in said, said


def test_an_extra_operation_is_named_before_what_it_leaves_behind():
    def quiet(x, w):  # the same names, the backward of another loss
        total = torch.zeros(w.shape[1], dtype=x.dtype)
        for row in x:
            total += row @ w
        loss = total.sum() / len(x)
        (2 * loss).backward()
        return loss.detach()

    said = _departs(quiet)
    assert "runs mul" in said, said  # the extra product is an operation the lesson never runs


def counted(xs):
    sent, labels = 0, -torch.ones(3, 3)
    for x in xs:
        sent += x.numel()
    labels += 2 * torch.eye(3)
    return sent, labels


def test_a_count_assigned_where_the_lesson_adds_and_a_diagonal_are_read():
    def overwritten(xs):  # each count assigned, not added
        sent, labels = 0, -torch.ones(3, 3)
        for x in xs:
            sent = x.numel()
        labels += 2 * torch.eye(3)
        return sent, labels

    def diagonal(xs):  # the eye added once: the diagonal 0, not +1
        sent, labels = 0, -torch.ones(3, 3)
        for x in xs:
            sent += x.numel()
        labels += torch.eye(3)
        return sent, labels

    xs = [torch.zeros(2), torch.zeros(3)]
    for answer, words in ((overwritten, "only what this statement adds"), (diagonal, "only the diagonal differs")):
        answer.__code__ = answer.__code__.replace(co_name="counted")
        shadow = Shadow(counted, Path(HERE), Path(HERE), agree=lambda ok: ok)
        shadow.wrap(answer)(xs)
        assert words in shadow.departs, shadow.departs
    assert "yours holds 0 there, the lesson's 1" in shadow.departs, shadow.departs
