"""The exercises' judge itself, without processes: what `Claims` measures, that each signature recognises
its trace and rejects a look-alike, that a failure no catalogued mistake explains is reported as what the
judge saw (a ratio read only as one possibility, where no structural claim contradicts it), that claims agree
across ranks, that a peer's transport error is never blamed on the rank that saw it, that hints come level by
level, that `Watch` counts what is alive and prices collectives by the ring formulas (an all-to-all by the rows
that leave the rank), and that `pytest --exercises -k NN` collects exercise NN's file alone."""

import dataclasses
import subprocess
import sys
from pathlib import Path

import torch
from exercise_claims import Claims
from exercise_ratios import name_ratio
from exercise_signatures import (
    Confined,
    Equals,
    Findings,
    Mistake,
    OnRanks,
    Proportional,
    Says,
    Scaled,
    Tensors,
    Zero,
    all_but,
    diagnose,
)
from exercise_watch import Watch, _part_sent, spanning

ROOT = Path(__file__).resolve().parent.parent
WANT = torch.arange(1.0, 7.0, dtype=torch.float64).reshape(2, 3)
HINTS = ("the idea", "the step", "nearly the line")


def _findings(per_rank_got: list, **extra) -> Findings:
    """Every rank's Seen of one tensor claim "c", got against WANT."""
    ranks = []
    for got in per_rank_got:
        claims = Claims()
        claims.close("c", got, WANT, what="t", **extra)
        ranks.append(claims.seen)
    return Findings(ranks)


def _diagnosed(findings: Findings, *seen, holds=(), fails=(), world=None):
    mistake = Mistake("m", "c", seen, HINTS, holds=holds, fails=fails)
    return diagnose(findings, (mistake,), world or len(findings.by_rank))


def test_a_factor_is_recognised_exactly_and_noise_is_not():
    by_p = Scaled("P", lambda p: p)
    assert _diagnosed(_findings([3 * WANT] * 3), by_p).mistake is not None
    assert _diagnosed(_findings([2 * WANT] * 3), by_p).mistake is None
    noisy = 3 * WANT + torch.tensor([[1e-6, 0, 0], [0, 0, 0]], dtype=torch.float64)
    assert _diagnosed(_findings([noisy] * 3), by_p).mistake is None


def test_equals_zero_and_confined_read_what_was_measured():
    alt = WANT.flip(0)
    assert _diagnosed(_findings([alt], alternatives={"flipped": alt}), Equals("flipped")).mistake is not None
    assert _diagnosed(_findings([alt + 1], alternatives={"flipped": alt}), Equals("flipped")).mistake is None
    assert _diagnosed(_findings([torch.zeros_like(WANT)]), Zero()).mistake is not None
    assert _diagnosed(_findings([None]), Zero()).mistake is not None
    assert _diagnosed(_findings([WANT.flip(1)]), Zero()).mistake is None
    row = torch.tensor([[True], [False]]).expand(2, 3)
    off_in_row_0 = WANT.clone()
    off_in_row_0[0] += 1
    assert _diagnosed(_findings([off_in_row_0], regions={"row 0": row}), Confined("row 0")).mistake is not None
    assert _diagnosed(_findings([WANT + 1], regions={"row 0": row}), Confined("row 0")).mistake is None


def test_which_ranks_and_which_tensors():
    assert _diagnosed(_findings([WANT, WANT + 1, WANT + 2]), all_but(0)).mistake is not None
    assert _diagnosed(_findings([WANT + 1, WANT, WANT + 2]), all_but(0)).mistake is None
    last = OnRanks("the last rank", lambda p: {p - 1})
    assert _diagnosed(_findings([WANT, WANT, WANT + 1]), last).mistake is not None
    claims = Claims()
    claims.tensors("c", {"a": WANT, "s": WANT + 1}, {"a": WANT, "s": WANT}, what="grads")
    assert _diagnosed(Findings([claims.seen]), Tensors(("s",))).mistake is not None
    assert _diagnosed(Findings([claims.seen]), Tensors(("a",))).mistake is None
    assert _diagnosed(Findings([claims.seen]), Tensors(("a",), but=True)).mistake is not None


def test_proportional_wants_one_factor_over_several_tensors():
    claims = Claims()
    got = {"a": 7 * WANT, "b": 7 * WANT.T, "s": WANT + 1}
    claims.tensors("c", got, {"a": WANT, "b": WANT.T, "s": WANT}, what="updates")
    assert _diagnosed(Findings([claims.seen]), Proportional(but=("s",))).mistake is not None
    assert _diagnosed(Findings([claims.seen]), Proportional()).mistake is None


def test_holds_fails_and_the_checks_own_words_tell_look_alikes_apart():
    claims = Claims()
    claims.holds("c", False, what="the schedule", note="the schedule deadlocks")
    claims.equal("d", 1, 1, what="n")
    findings = Findings([claims.seen])
    assert _diagnosed(findings, Says("deadlocks")).mistake is not None
    assert _diagnosed(findings, Says("twice")).mistake is None
    assert _diagnosed(findings, Says("deadlocks"), holds=("d",)).mistake is not None
    assert _diagnosed(findings, Says("deadlocks"), fails=("d",)).mistake is None


def test_an_unrecognised_failure_is_reported_as_what_the_judge_saw():
    findings = _findings([WANT, 2.5 * WANT, WANT + 1], alternatives={"flipped": WANT.flip(0)})
    diagnosis = _diagnosed(findings, Scaled("P", lambda p: p))
    assert diagnosis.mistake is None
    text = diagnosis.message(3)
    for fact in ("claim 'c' failed on rank(s) 1, 2", "ranks that held: 0", "rank 1: 2.5", "rank 2: no single factor"):
        assert fact in text, text
    assert "equals none of: flipped" in text and "no catalogued mistake" in text
    assert not any(hint in text for hint in HINTS)  # the catalogue's hints belong to its mistake only


def test_hints_come_one_level_at_a_time():
    diagnosis = _diagnosed(_findings([3 * WANT]), Scaled("3", lambda p: 3))
    for level in range(4):
        text = diagnosis.message(level)
        assert [hint in text for hint in HINTS] == [k < level for k in range(3)], text
        assert ("the judge saw" in text) == (level > 0)
        assert ("--hint-level" in text) == (level < 3)


def test_watch_counts_what_is_alive_and_sees_every_shape():
    with Watch(lambda shape: "block" if shape == (4, 5) else None) as watch:
        kept = [torch.ones(4, 5) for _ in range(3)]
        del kept[:2]
        torch.ones(4, 5) + 1  # a temporary, freed at once
        torch.zeros(12, 12)
    assert watch.peak["block"] == 3 and watch.live["block"] == 1
    assert spanning(watch.shapes, 12, {12}) == [(12, 12)] and spanning(watch.shapes, 4, {12}) == []


def test_watch_prices_collectives_by_the_ring_formulas():
    watch = Watch()
    watch.collectives = [("all_reduce", 300), ("all_gather", 300), ("reduce_scatter", 300), ("send", 40)]
    assert watch.sent(3) == 2 * 2 / 3 * 300 + 2 / 3 * 300 + 2 / 3 * 300 + 40


class _Group:
    """What `_part_sent` asks of a process group: this rank's index and the world size."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size = (lambda: rank), (lambda: size)


def test_watch_prices_an_all_to_all_by_the_rows_that_leave_the_rank():
    rows = torch.zeros(6, 4, dtype=torch.float64)  # a row: 32 bytes
    assert _part_sent(rows, [1, 3, 2], _Group(1, 3)) == (6 - 3) * 32  # uneven: rank 1 keeps its 3 rows
    assert _part_sent(rows, [1, 3, 2], _Group(0, 3)) == (6 - 1) * 32
    assert _part_sent(rows, None, _Group(2, 3)) == (6 - 2) * 32  # no splits: P equal parts
    assert _part_sent(rows[:0], [0, 0, 0], _Group(0, 3)) == 0
    watch = Watch()
    watch.collectives = [("all_to_all", 96), ("all_gather", 300)]
    assert watch.sent(3) == 96 + 2 / 3 * 300  # recorded as sent, not priced again by a ring formula


def test_exercises_k_nn_collects_that_exercise_alone():
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--exercises", "-k", "6", "--collect-only", "-q", "-p", "no:cacheprovider"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    collected = [line for line in done.stdout.splitlines() if "::" in line]
    assert collected == ["tests/test_exercise06_data_parallel.py::test_exercise"], done.stdout + done.stderr


def test_a_ratio_is_named_in_the_exercises_quantities():
    assert name_ratio(1 / 9, {"P": 3}).startswith("1/P^2 = 0.111111: divided by P twice")
    assert name_ratio(1 / 3, {"P": 3}).startswith("1/P = 0.333333")
    assert name_ratio(0.25, {"P": 3, "M": 4}).startswith("1/M = 0.25")
    assert "P/2" in name_ratio(1.5, {"P": 3})  # (P - 1) where 2 (P - 1)/P belongs (= P/(P-1) at P = 3)
    assert "(= M here)" in name_ratio(4.0, {"P": 4, "M": 4})  # two quantities equal: both named
    both = name_ratio(4 / 3, {"P": 3, "C": 4})  # C/(C-1) = C/P here: each reading offered, neither dropped
    assert "one part counted" in both and "a factor C where P belongs" in both, both
    assert name_ratio(0.2718, {"P": 3, "M": 4}) is None and name_ratio(None, {"P": 3}) is None
    text = _diagnosed(_findings([WANT / 9, WANT / 9, WANT / 9]), Scaled("P", lambda p: p)).message(1)
    assert "one reading, not a diagnosis: 1/P^2 = 0.111111: divided by P twice" in text, text
    assert "P/2" not in name_ratio(1.5, {"P": 3}, rings=False)  # a ring's reading only for a claim about bytes


def test_a_ratio_is_read_only_where_the_structure_agrees_with_a_mere_factor():
    """A factor is one possibility, offered only when every rank missed alike and no structural claim failed:
    an answer that ran the wrong exchange is described by what it ran, not by a reading of its numbers."""

    def ranks(bytes_ok: bool, gots: list) -> Findings:
        by_rank = []
        for got in gots:
            claims = Claims()
            claims.close("the output equals one process's", got, WANT, what="t")
            claims.equal("bytes sent = the formula", 8 if bytes_ok else 16, 8, what="bytes")
            by_rank.append(claims.seen)
        return Findings(by_rank)

    read = diagnose(ranks(True, [3 * WANT] * 3), (), 3, numbers="equals").observations
    assert any(f.startswith("one reading, not a diagnosis: P = 3") for f in read), read
    unread = diagnose(ranks(False, [3 * WANT] * 3), (), 3, numbers="equals").observations
    assert not any("reading" in f for f in unread), unread
    assert any("'bytes sent = the formula' failed too" in f and "16, not 8" in f for f in unread), unread
    some = diagnose(ranks(True, [WANT, 3 * WANT, 3 * WANT]), (), 3, numbers="equals").observations
    assert not any("reading" in f for f in some) and "ranks that held: 0" in some, some


def test_more_help_is_offered_only_where_more_exists_and_never_after_no_mistake():
    no_hints = _diagnosed(_findings([2.5 * WANT]), Scaled("P", lambda p: p))
    assert "--hint-level 1" in no_hints.message(0)  # level 1 adds what the judge saw
    assert "--hint-level" not in no_hints.message(1)  # and nothing after it
    claims = Claims()
    claims.close("c", 2.5 * WANT, WANT, what="t", hints=("the claim's own idea",))
    own = _diagnosed(Findings([claims.seen]), Scaled("P", lambda p: p))
    text = own.message(1)
    assert "the claim's own idea" in text and "no catalogued mistake" not in text, text
    assert "--hint-level" not in text  # its one hint shown: no more to come
    carried_on = own.message(3, fallback=HINTS)  # the claim's one hint, then the exercise's step and line
    assert "hint 1: the claim's own idea" in carried_on and "hint 3: nearly the line" in carried_on, carried_on
    fallback = no_hints.message(2, fallback=HINTS)
    assert "the idea" in fallback and "the step" in fallback and "--hint-level 3" in fallback, fallback
    assert "no catalogued mistake" not in fallback


def test_an_answer_that_raises_is_a_verdict_naming_its_own_line_not_a_traceback():
    from exercise_kit import Answer
    from exercise_ranks import _raised

    from distlab.processes.spawn import SpawnError

    answer = Answer(ROOT / "lessons/exercises/06_data_parallel.py", "all_reduce_gradients")
    child = (
        "Traceback (most recent call last):\n"
        '  File "/x/judge.py", line 3, in body\n    fn(model, rt)\n'
        f'  File "{answer.path}", line 41, in all_reduce_gradients\n    dist.all_reduce(grads)\n'
        '  File "/torch/c10d.py", line 9, in all_reduce\n    work = group.allreduce([tensor])\n'
        "TypeError: all_reduce(): argument 'tensor' must be Tensor, not list\n"
    )
    text = _raised(SpawnError(2, child), answer)
    assert text.startswith("your answer raised on rank 2: TypeError: all_reduce(): argument"), text
    assert "06_data_parallel.py:41 in all_reduce_gradients: dist.all_reduce(grads)" in text, text
    assert "did not finish" in _raised(TimeoutError("ranks [1] did not finish within 240 s"), answer)
    peer = child.replace(
        "TypeError: all_reduce(): argument 'tensor' must be Tensor, not list",
        "RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:9089",
    )
    text = _raised(SpawnError(0, peer), answer, "\n  what each rank's answer ran: rank 0: reduce; rank 1: nothing")
    assert text.startswith("the ranks stopped running the same collectives: rank 0 was left"), text
    assert "raised on rank 0" not in text and "rank 1: nothing" in text, text


def test_an_answer_that_raises_is_told_with_the_values_on_its_raising_line(tmp_path):
    """The child notes the names on the answer's raising line and their values (a frozen parameter's .grad is
    None); a raise outside the answer's file (the judge's backward of its loss) is told by what it returned."""
    import traceback

    from exercise_kit import Answer
    from exercise_ranks import _raised
    from exercise_values import noted

    from distlab.processes.spawn import SpawnError

    path = tmp_path / "06_data_parallel.py"
    path.write_text(
        "import torch\n\n\ndef all_reduce_gradients(model):\n    for param in model.parameters():\n"
        "        param.data = torch.add(\n            param.grad, 1\n        )\n"
        "\n\ndef loss(x):\n    return x.detach().sum()\n"
    )
    model = torch.nn.Linear(8, 8, bias=False).double().requires_grad_(False)
    try:
        Answer(path, "all_reduce_gradients").load()(model)
    except TypeError as err:
        noted(err, path)
        child = traceback.format_exc()
    text = _raised(SpawnError(0, child), Answer(path, "all_reduce_gradients"))
    assert text.startswith("your answer raised on rank 0: TypeError: add(): argument"), text
    assert text.endswith(
        "06_data_parallel.py:6 in all_reduce_gradients: param.data = torch.add(\n"
        "  values at that line: param.data: float64 [8, 8], no graph; param: float64 [8, 8], requires_grad False; "
        "param.grad = None"
    ), text
    returned = Answer(path, "loss").load()(torch.ones(3, requires_grad=True))
    try:
        returned.backward()
    except RuntimeError as err:
        noted(err, path, returned)
        child = traceback.format_exc()
    text = _raised(SpawnError(1, child), Answer(path, "loss"))
    assert text.startswith("your answer raised on rank 1: RuntimeError: element 0 of tensors"), text
    assert text.endswith("\n  the answer's last call returned: float32 [] = 3.0, no graph"), text


def test_claims_agree_across_ranks_so_a_body_stops_on_every_rank_at_once():
    """With `agree`, a claim that failed on one rank returns False on all: each Seen keeps its own outcome."""
    claims = Claims(agree=lambda ok: False)  # another rank failed
    assert claims.equal("c", 1, 1, what="n") is False and claims.seen[0].ok
    assert Claims().equal("c", 1, 1, what="n") is True


def test_a_planted_slip_changes_one_text_of_the_lesson_and_nothing_else():
    from exercise_kit import solution
    from exercise_slips import Planted

    judged = solution("data_parallel", "all_reduce_gradients")
    slip = Planted(judged.path, judged.name, "param.grad /= rt.world_size", "param.grad /= 2 * rt.world_size", "x")
    planted = slip.load()
    assert planted is not judged.load() and judged.load().__code__.co_firstlineno == planted.__code__.co_firstlineno
    assert "2 * rt.world_size" not in judged.path.read_text()  # the lesson's file is never touched
    gone = Planted(judged.path, judged.name, "a text the lesson does not hold", "", "x")
    try:
        gone.load()
    except ValueError as err:
        assert "no longer fits" in str(err)
    else:
        raise AssertionError("a slip whose text is gone must say so, not judge the lesson unchanged")


def test_a_factor_on_some_tensors_only_is_not_read_as_a_factor_on_all():
    claims = Claims()
    want = {"a": WANT, "b": 2 * WANT, "frozen": torch.zeros(2)}
    claims.tensors("c", {"a": 3 * WANT, "b": 2 * WANT, "frozen": torch.zeros(2)}, want, what="t")
    findings = Findings([claims.seen])
    assert Scaled("P", lambda p: p).match(findings.failing("c"), 3) is None  # b is right: not "every tensor P times"
    facts = diagnose(findings, (), 3).observations
    assert any("tensors that held: b" in fact for fact in facts), facts  # "frozen" is zero: it proves nothing
    claims = Claims()
    claims.tensors("c", {"a": 3 * WANT, "b": 6 * WANT, "frozen": torch.zeros(2)}, want, what="t")
    assert Scaled("P", lambda p: p).match(Findings([claims.seen]).failing("c"), 3)


def test_a_native_abort_is_told_by_the_error_it_wrote_not_by_its_crash_dump(tmp_path):
    """A rank killed inside gloo leaves no Python traceback: spawn's death note carries faulthandler's dump, whose
    last line lists extension modules. The verdict reads the error the rank wrote on its stderr (`_rank` keeps
    it), the sizes of gloo's mismatch in words with the rank's last call, and the answer's line from the dump."""
    from exercise_kit import Answer
    from exercise_ranks import _raised

    from distlab.processes.spawn import SpawnError

    answer = Answer(ROOT / "lessons/exercises/06_data_parallel.py", "all_reduce_gradients")
    lines = answer.path.read_text().splitlines()
    at = next(k for k, line in enumerate(lines) if "raise NotImplementedError" in line) + 1  # the blank's own line
    (tmp_path / "0-1.err").write_text(
        "terminate called after throwing an instance of 'gloo::EnforceNotMet'\n"
        "  what():  [enforce fail at gloo/transport/tcp/pair.cc:456] op.preamble.length <= op.nbytes. 384 vs 256. "
        "Received data size doesn't match expected size. Is there a distributed collective mismatch in your code?\n"
    )
    (tmp_path / "0-1").write_text("recv from rank 0 on ranks 0-2\n")
    dump = (
        "process exited with code -6 and no traceback (killed by signal 6); its faulthandler wrote:\n"
        "Fatal Python error: Aborted\n\nCurrent thread 0x01 (most recent call first):\n"
        '  File "/torch/distributed/distributed_c10d.py", line 2600 in recv\n'
        f'  File "{answer.path}", line {at} in all_reduce_gradients\n'
        '  File "/x/judge.py", line 3 in body\n\n'
        "Extension modules: numpy._core._multiarray_umath, torch._C (total: 2)\n(ranks [0, 2] failed after it)"
    )
    text = _raised(SpawnError(1, dump), answer, "", str(tmp_path))
    assert "Extension modules" not in text, text
    assert "gloo::EnforceNotMet: op.preamble.length <= op.nbytes. 384 vs 256. Received data size" in text, text
    assert "rank 1 was sent a message of 384 bytes at its recv from rank 0 on ranks 0-2, its receive buffer" in text
    assert f"06_data_parallel.py:{at} in all_reduce_gradients: {lines[at - 1].strip()}" in text, text
    (tmp_path / "0-1.err").unlink()  # nothing on its stderr: faulthandler's own first line, never the modules
    text = _raised(SpawnError(1, dump), answer, "", str(tmp_path))
    assert text.startswith("your answer raised on rank 1: Fatal Python error: Aborted"), text


def test_an_equals_reading_is_said_for_the_ranks_where_it_holds():
    """ "equals: X" only where every failing rank equals X, else rank by rank."""
    findings = _findings([WANT.flip(0), WANT + 1, WANT + 1], alternatives={"flipped": WANT.flip(0)})
    text = _diagnosed(findings, Scaled("P", lambda p: p)).message(1)
    assert "on rank 0: equals: flipped; on ranks 1, 2: equals none of: flipped" in text, text
    findings = _findings([WANT.flip(0)] * 2, alternatives={"flipped": WANT.flip(0)})
    assert "; equals: flipped" in _diagnosed(findings, Scaled("P", lambda p: p)).message(1)


def test_blocks_in_another_order_are_read_as_such():
    """got is the reference cut in P blocks along a dimension, the blocks in another order: which block is where."""
    from exercise_claims import _placed
    from exercise_signatures import describe

    want = torch.arange(12.0, dtype=torch.float64).reshape(2, 6)
    got = torch.cat([want[:, 4:], want[:, :2], want[:, 2:4]], dim=1)
    assert _placed(got, want, 1e-12, 3) == (1, (2, 0, 1))
    assert _placed(want, want, 1e-12, 3) == () and _placed(got + 1, want, 1e-12, 3) == ()
    seen = Claims()
    seen.close("c", got, want, what="Y")
    failing = {0: dataclasses.replace(seen.seen[0], placed=(1, (2, 0, 1))), 2: seen.seen[0]}
    assert "Y's 3 blocks along dim 1 hold the reference's blocks 2, 0, 1 on rank 0" in "; ".join(describe(failing, 3))


def test_a_schedules_count_of_each_kind_is_told_against_the_lessons():
    from exercise_schedules import departure, tally

    from distlab.model_split.schedules import Action

    lesson = [[Action("F", 0, 0), Action("I", 0, 0), Action("W", 0, 0), Action("F", 0, 3), Action("W", 0, 3)]]
    mine = [[Action("F", 0, 0), Action("I", 0, 0), Action("F", 0, 3), Action("W", 0, 0), Action("W", 0, 3)]]
    assert tally(mine, lesson) == "" and "is 3F0" in departure(mine, lesson, 1)
    assert tally([mine[0][:4]], lesson) == "rank 0 runs 1 W, the lesson's order 2 W"
