"""Lesson 20: DiLoCo islands (DDP inside, the outer Nesterov step on the pseudogradients by hand) equal
torchft's DiLoCo (init_sync=False) and a one-process simulation of the islands bit for bit, at P = 2 (the
lesson under torchrun, its claims read from its JSON) and, for the outer step, in one process here; torchft's
default heal is the simulation with one island's first round counted twice; the outer step written by hand
equals torch's Nesterov SGD and a wrong twin (no look-ahead) is rejected; a sign slip changes the result;
bad input (H < 1, a fragment count that does not divide the layers or H, an odd P) is one line naming the
flag; after the run no rank and no Lighthouse is left (checked by process id and by the port)."""

import argparse
import json
import os
import socket

import pytest
import torch
from helpers import assert_flag_refused, load_lesson, torchrun

LESSON = "diloco"


def _args(**kw):
    base = dict(seed=0, h=4, rounds=3, fragments=1)
    return argparse.Namespace(**{**base, **kw})


def test_outer_nesterov_by_hand_equals_torch_and_a_wrong_twin_is_rejected():
    lesson = load_lesson(LESSON)
    grads = [torch.randn(5, dtype=torch.float64, generator=torch.Generator().manual_seed(k)) for k in range(4)]
    mine, theirs = torch.ones(5, dtype=torch.float64), torch.nn.Parameter(torch.ones(5, dtype=torch.float64))
    outer = lesson.OuterNesterov(0.7, 0.9)
    opt = torch.optim.SGD([theirs], lr=0.7, momentum=0.9, nesterov=True)
    plain = torch.optim.SGD([twin := torch.nn.Parameter(torch.ones(5, dtype=torch.float64))], lr=0.7, momentum=0.9)
    for g in grads:
        outer.step(mine, g)
        theirs.grad, twin.grad = g.clone(), g.clone()
        opt.step()
        plain.step()
    assert torch.equal(mine, theirs.detach())  # bit for bit
    assert not torch.allclose(mine, twin.detach())  # heavy-ball momentum without the look-ahead: rejected


def test_simulation_islands_agree_after_a_whole_round_and_the_sign_slip_differs():
    lesson = load_lesson(LESSON)
    islands = lesson.simulate(_args(rounds=2), members=2)
    assert lesson.same_bits(islands[0], islands[1])  # F = 1: every island holds theta after the outer step
    slipped = lesson.simulate(_args(rounds=2), members=2, sign=-1.0)
    assert not lesson.same_bits(islands[0], slipped[0])
    healed = lesson.simulate(_args(rounds=1), members=1, heal_from=0)
    twice = lesson.simulate(_args(rounds=1, seed=0), members=1)
    assert not lesson.same_bits(healed[0], twice[0])  # counting island 0 twice is a different run


def test_streaming_fragments_leave_the_unsynced_fragment_local():
    lesson = load_lesson(LESSON)
    a, b = lesson.simulate(_args(h=4, rounds=1, fragments=2), members=1)
    last = lesson.fragments_of(a, 2)[1].parameters()  # synced at step 4, the last
    first = lesson.fragments_of(a, 2)[0].parameters()  # synced at step 2, then 2 more local steps
    assert all(torch.equal(p, q) for p, q in zip(last, lesson.fragments_of(b, 2)[1].parameters()))
    assert not all(torch.equal(p, q) for p, q in zip(first, lesson.fragments_of(b, 2)[0].parameters()))
    assert [lesson.synced_fragment(s, 4, 2) for s in range(1, 9)] == [None, 0, None, 1, None, 0, None, 1]


@pytest.mark.parametrize(
    ("flag", "args"), [("--h", ("--h", "0")), ("--rounds", ("--rounds", "0")), ("--fragments", ("--fragments", "0"))]
)
def test_non_positive_flags_refused(flag, args):
    assert_flag_refused(LESSON, flag, *args)


@pytest.mark.parametrize(
    ("kw", "world", "match"),
    [
        ({"fragments": 3}, 2, "--fragments: F = 3 does not divide the model's 4 layers"),
        ({"fragments": 4, "h": 2}, 2, "--fragments: F = 4 does not divide H = 2"),
        ({}, 3, "--nproc-per-node: P = 3"),
    ],
)
def test_world_rules_one_line(kw, world, match):
    lesson = load_lesson(LESSON)
    with pytest.raises(ValueError, match=match.replace("(", r"\(")):
        lesson.world_rules(_args(**kw), world)


def test_lesson_at_p2_holds_and_leaves_nothing_running(tmp_path):
    out = tmp_path / "diloco.json"
    run = torchrun(LESSON, 2, "--fragments", "2", "--json", str(out), columns=80)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    assert "PASS: every claim holds" in run.stdout, run.stdout
    assert max(len(line) for line in run.stdout.splitlines()) <= 80, run.stdout
    record = json.loads(out.read_text())
    names = [c["name"] for c in record["checks"] if c["ok"]]
    assert any("torchft (init_sync=False)" in n for n in names) and any("counted twice" in n for n in names)
    for pid in record["figures"]["rank_pids"]:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # the rank is gone
    assert len(record["figures"]["lighthouses"]) == 2  # one Lighthouse per torchft run, both closed:
    for address in record["figures"]["lighthouses"]:
        host, port = address.removeprefix("http://").rsplit(":", 1)
        with pytest.raises(OSError), socket.create_connection((host.strip("[]"), int(port)), timeout=2):
            pass
    assert record["figures"]["bytes_per_round_ddp"] == 4 * record["figures"]["bytes_per_round_diloco"]
