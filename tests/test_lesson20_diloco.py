"""Lesson 20: DiLoCo islands (DDP inside, the outer Nesterov step on the pseudogradients by hand) equal
torchft's DiLoCo (init_sync=False) and a one-process simulation of the islands bit for bit, at P = 2 (the
lesson under torchrun, its claims read from its JSON) and, for the outer step, in one process here; torchft's
default heal is the simulation with one island's first round counted twice; the outer step written by hand
equals torch's Nesterov SGD and a wrong twin (no look-ahead) is rejected; a sign slip changes the result;
an island lost mid-round: the one-process reference's lost syncs are the survivor's DiLoCo alone (against a
one-island loop written here, a mean over the configured 2 islands rejected) and the sync of its return, healed,
is the survivor's alone too; under torchrun island 1's processes are SIGKILLed, the survivors' torchft run and the
restarted island equal that reference bit for bit (the lesson's claims); bad input (H < 1, a fragment count that
does not divide the layers or H, an odd P) is one line naming the flag; after the run no rank, no island process
and no Lighthouse is left (checked by process id and by the port); torchft's own log lines stay out of the output
unless --torchft-logs asks for them."""

import argparse
import copy
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


def _one_island(lesson, args, mean_over: int):
    """Island 0 alone, written out: H SGD steps on its rows, then delta = theta - theta_0 (divided by
    `mean_over`) as the gradient of torch's Nesterov SGD on theta; the island starts the next round at theta."""
    theta = lesson.build_model(args.seed)
    local = copy.deepcopy(theta)
    outer = torch.optim.SGD(theta.parameters(), lr=lesson.OUTER_LR, momentum=lesson.OUTER_MOMENTUM, nesterov=True)
    inner = torch.optim.SGD(local.parameters(), lr=lesson.INNER_LR)
    for step in range(1, args.rounds * args.h + 1):
        inner.zero_grad()
        lesson.loss_of(local, *lesson.rows(args.seed, step, 0, 0)).backward()
        inner.step()
        if step % args.h == 0:
            for t, mine in zip(theta.parameters(), local.parameters()):
                t.grad = (t - mine).detach() / mean_over
            outer.step()
            local.load_state_dict(theta.state_dict())
    return theta


def test_a_lost_islands_syncs_are_the_survivors_alone():
    lesson = load_lesson(LESSON)
    args = _args(rounds=3)
    never_back = lesson.simulate(args, members=1, lost=(0, 99))[0]  # island 1 lost before the first sync
    assert lesson.same_bits(never_back, _one_island(lesson, args, mean_over=1))  # bit for bit
    assert not lesson.same_bits(never_back, _one_island(lesson, args, mean_over=2))  # the dead island as zero


def test_the_sync_of_a_healed_return_is_the_survivors_alone_then_both_count():
    lesson = load_lesson(LESSON)
    healed = lesson.simulate(_args(rounds=3), members=1, lost=(1, 2))  # back (healed) at sync 2
    out = lesson.simulate(_args(rounds=3), members=1, lost=(1, 3))  # still out at sync 2
    assert all(lesson.same_bits(a, b) for a, b in zip(healed, out))  # (delta_0 + delta_0) / 2 = delta_0
    four_healed = lesson.simulate(_args(rounds=4), members=1, lost=(1, 2))
    four_out = lesson.simulate(_args(rounds=4), members=1, lost=(1, 4))
    assert not lesson.same_bits(four_healed[0], four_out[0])  # at sync 3 the healed island counts


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
    for torchft_line in ("[torchft::", "Unable to reset NCCL", "GET /checkpoint", "buffer is not writable"):
        assert torchft_line not in run.stdout + run.stderr  # quiet by default: --torchft-logs shows them
    record = json.loads(out.read_text())
    names = [c["name"] for c in record["checks"] if c["ok"]]
    assert any("torchft (init_sync=False)" in n for n in names) and any("counted twice" in n for n in names)
    assert any("SIGKILLed mid-round" in n for n in names) and any("round dropped" in n for n in names)
    islands = record["figures"]["island_pids"]
    assert len(islands) == 3  # island 0's process, island 1's killed one and its restart
    for pid in record["figures"]["rank_pids"] + islands:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # the rank, or the island process, is gone
    assert len(record["figures"]["lighthouses"]) == 3  # one Lighthouse per torchft run, all closed:
    for address in record["figures"]["lighthouses"]:
        host, port = address.removeprefix("http://").rsplit(":", 1)
        with pytest.raises(OSError), socket.create_connection((host.strip("[]"), int(port)), timeout=2):
            pass
    assert record["figures"]["bytes_per_round_ddp"] == 4 * record["figures"]["bytes_per_round_diloco"]
