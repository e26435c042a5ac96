"""Lesson 06: the collectives compute what one process computes and a ring sends what its formula
says; data parallelism (by hand, with buckets from hooks, DDP, DDP with no_sync) equals one process on
the whole batch; DDP needs find_unused_parameters for a step that leaves a branch out; and DDP's
average is right for a mean over samples and exactly P times too small for a loss every rank
computes whole."""

import time

import pytest
import torch
from helpers import assert_same_error_on_every_rank, load_lesson, torchrun

from distlab.comm.collectives import check_collective, full_numel, rank_input, ring_bytes
from distlab.data_split.data_parallel import ddp
from distlab.data_split.data_parallel.measure import MEASURED, library_ring, measure_collectives
from distlab.data_split.data_parallel.problem import DataParallelConfig, batch_lse_loss, build, check_config, mean_loss
from distlab.data_split.data_parallel.training import train
from distlab.processes.spawn import SpawnError, spawn
from distlab.proof.compare import all_ok, compare
from distlab.proof.reference import one_process, sgd

# N = 24 splits over 1, 2, 3 and 4 ranks; tiny float64 model, exact to rtol 1e-10 / atol 1e-12.
CFG = DataParallelConfig(global_batch=24, layers=3, width=8, steps=3, lr=0.2, seed=5)
BUCKET_BYTES = 300  # a few parameters per bucket: several buckets even for this tiny model
MICRO_BATCHES = 4  # C = 6 at P = 4: unequal parts at P = 3 (C = 8)


def _everything(rt):
    """Every claim of the lesson on one rank, with the lesson's own mechanisms."""
    lesson = load_lesson("data_parallel")
    out = {"collectives": []}
    n = full_numel(640, rt.world_size, torch.float64)
    for c in MEASURED:
        got, expected = check_collective(c, rt, n, 1, torch.float64)
        x = rank_input(c, n, rt.rank, rt, 1, torch.float64)
        by_hand, sent = lesson.ring_by_hand(rt, c.name, x)
        library, library_sent = library_ring(rt, c.name, x)  # comm's Ring, the lesson's twin
        formula = ring_bytes(c.name, n, 8, rt.world_size, rt.rank)
        out["collectives"].append((c.name, got, by_hand, expected, sent, formula, library, library_sent))
    model = build(CFG)[0]
    out["by_hand"] = train(rt, CFG, model, lambda: lesson.all_reduce_gradients(model, rt))
    bucketed = build(CFG)[0]
    buckets = lesson.GradientBuckets(bucketed, rt, BUCKET_BYTES)
    out["buckets"] = (train(rt, CFG, bucketed, buckets.wait), len(buckets.buckets))
    after = build(CFG)[0]
    out["buckets_after"] = train(rt, CFG, after, lesson.GradientBuckets(after, rt, BUCKET_BYTES, overlap=False).wait)
    out["ddp"] = train(rt, CFG, ddp.wrap(build(CFG)[0], rt), lambda: None)
    out["no_sync"] = ddp.accumulate(rt, CFG, MICRO_BATCHES, no_sync=True)
    out["every"] = ddp.accumulate(rt, CFG, MICRO_BATCHES, no_sync=False)
    out["unused"] = {flag: ddp.unused_branch(rt, CFG, flag) for flag in (False, True)}
    out["global"] = ddp.global_loss_gradients(rt, CFG, times_p=False)
    out["global_xP"] = ddp.global_loss_gradients(rt, CFG, times_p=True)
    return out


@pytest.fixture(scope="module")
def references():
    model, x, target = build(CFG)
    return {
        "mean": one_process(model, lambda k: (x, target), mean_loss, sgd(CFG.lr), CFG.steps),
        "global": one_process(model, lambda k: (x, target), batch_lse_loss, sgd(CFG.lr), 1),
        "branchy": ddp.branchy_reference(CFG),
    }


def _same_run(ref, run):
    return (
        all_ok(compare(ref.first_grads, run.first_grads))
        and all_ok(compare(ref.params, run.params))
        and torch.allclose(torch.tensor(run.losses), torch.tensor(ref.losses), rtol=1e-10, atol=0)
    )


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_every_claim(world_size, references):
    per_rank = spawn(_everything, world_size)
    ref, p = references["mean"], world_size
    assert ref.losses[-1] < ref.losses[0]  # it trains, so equal parameters mean something
    for rank, out in enumerate(per_rank):
        # The collectives: torch's and the lesson's ring's results equal one process's; bytes = the formula;
        # the lesson's ring and comm's Ring are one algorithm: the same result bit for bit, the same bytes.
        for name, got, by_hand, expected, sent, formula, library, library_sent in out["collectives"]:
            assert torch.allclose(got, expected, rtol=1e-10, atol=1e-12), name
            assert torch.allclose(by_hand, expected, rtol=1e-10, atol=1e-12), name
            assert sent == formula, (name, rank, sent, formula)
            assert torch.equal(by_hand, library) and sent == library_sent, (name, rank)
        # Data parallel on the mean loss: every way equals one process on the whole batch.
        assert _same_run(ref, out["by_hand"])
        run, n_buckets = out["buckets"]
        assert _same_run(ref, run) and n_buckets > 2
        assert _same_run(ref, out["buckets_after"])
        assert _same_run(ref, out["ddp"])
        # no_sync: the same gradient, DDP's hook called once per bucket in the last backward only.
        (grads_sync, calls_sync), (grads_every, calls_every) = out["no_sync"], out["every"]
        assert all_ok(compare(ref.first_grads, grads_sync)) and all_ok(compare(ref.first_grads, grads_every))
        assert calls_sync >= 1 and calls_every == MICRO_BATCHES * calls_sync
        # find_unused_parameters: without it step 2 is not averaged (P > 1) and step 3 raises.
        without, with_flag = out["unused"][False], out["unused"][True]
        assert "Expected to have finished reduction" in without.error and len(without.grads) == 2
        assert without.ranks_agree == [True, p == 1]
        assert all_ok(compare(references["branchy"][0], without.grads[0]))
        assert with_flag.error is None and with_flag.ranks_agree == [True] * 3
        assert all(all_ok(compare(r, g)) for r, g in zip(references["branchy"], with_flag.grads))
        # The one fact: a loss every rank computes whole gets 1/P of its gradient from DDP's average.
        glob = references["global"]
        loss, plain = out["global"]
        assert loss == pytest.approx(glob.losses[0], rel=1e-10)
        assert all_ok(compare({k: v / p for k, v in glob.first_grads.items()}, plain))
        assert all_ok(compare(glob.first_grads, out["global_xP"][1]))
        # The check can fail: with more than one rank the plain gradient is not the reference.
        assert all_ok(compare(glob.first_grads, plain)) == (p == 1)


def _shifted_ring(rt, name, x):
    """comm's ring with its result rolled by one element, and one byte too many: a wrong ring by hand."""
    result, sent = library_ring(rt, name, x)
    return result.roll(1), sent + 1


def _rows_with(rt, by_hand):
    return [(row.ring_ok, row.same_as_library) for row in measure_collectives(rt, 640, torch.float64, 1, 1, by_hand)]


def test_the_ring_checks_reject_a_wrong_ring():
    """The lesson's claims about its rings can fail: a ring off by one element and one byte fails both
    (one process's result, comm's Ring), and the library's own ring passes both."""
    wrong, right = spawn(_rows_with, 2, _shifted_ring)[0], spawn(_rows_with, 2, library_ring)[0]
    assert all(row == (False, False) for row in wrong), wrong
    assert all(row == (True, True) for row in right), right


def _no_division(rt):
    """The by-hand loop without its division by P: a sum over ranks, P times the gradient."""
    import torch.distributed as dist

    model = build(CFG)[0]

    def sum_only():
        for param in model.parameters():
            dist.all_reduce(param.grad)

    return train(rt, CFG, model, sum_only).first_grads


def test_the_check_catches_a_sum_instead_of_a_mean(references):
    grads = spawn(_no_division, 2)[0]
    assert not all_ok(compare(references["mean"].first_grads, grads))
    assert all_ok(compare({k: 2 * v for k, v in references["mean"].first_grads.items()}, grads))


def test_global_batch_must_split_evenly():
    message = assert_same_error_on_every_rank(
        check_config, 3, DataParallelConfig(global_batch=10), match="--global-batch"
    )
    assert "P = 3" in message


def _ranks_disagree_on_the_branch(rt):
    """Rank 0 uses the branch, the others do not; no find_unused_parameters."""
    model = ddp.wrap(ddp.Branchy(CFG), rt)
    _, x, target = build(CFG)
    mean_loss(model(x, use_aux=rt.rank == 0), target).backward()
    time.sleep(6)  # stay alive past the group's timeout: rank 0 must fail by timing out, not by a peer leaving


def test_ranks_that_disagree_about_a_branch_wait_until_the_timeout():
    start = time.monotonic()
    with pytest.raises(SpawnError, match="(?i)timed? ?out"):
        spawn(_ranks_disagree_on_the_branch, 2, timeout_s=2)
    assert time.monotonic() - start >= 2


def test_the_lesson_passes_under_torchrun_at_80_columns():
    run = torchrun(
        "data_parallel",
        2,
        "--global-batch",
        "24",
        "--layers",
        "3",
        "--width",
        "8",
        "--message-mib",
        "0.01",
        "--repeats",
        "2",
        "--bucket-mib",
        "0.0005",
        "--emulate-ms",
        "0.5",
        columns=80,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "PASS: every claim holds" in run.stdout
    assert "\u2026" not in run.stdout
    # torch's find_unused_parameters warning, provoked on purpose: said once, in the lesson's words
    assert "did not find any unused parameters" not in run.stderr, run.stderr[-2000:]
    assert run.stdout.count("torch warned (on every rank; caught here and") == 1, run.stdout
