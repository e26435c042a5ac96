"""Lesson 10: expert parallelism equals one process's MoE on the whole batch (float64, output, every
gradient, parameters after SGD steps), top-1 and top-2, without drops and with drops under the stated
capacity rule, at P = 1, 2, 3, 4; the lesson's all-to-all and torch's `all_to_all_single_autograd` equal one
process forward and backward; every rank sends the formula's bytes; L_aux from each rank's own counts
has a measurably different gradient and the exchanged counts make it exact; capacity counted per rank
drops other tokens. Each check is also shown to fail on a wrong answer. Bad flags are one line naming
the flag, on every rank, before any collective."""

import math

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from helpers import (
    assert_flag_refused,
    assert_lesson_passes_at_80_columns,
    assert_same_error_on_every_rank,
    load_lesson,
)

from distlab.comm.differentiable import all_to_all
from distlab.comm.ledger import Ledger
from distlab.layer_split.expert_parallel import cost, runs
from distlab.layer_split.expert_parallel.checks import check_all_to_all
from distlab.layer_split.expert_parallel.moe import MoEBlock, MoEConfig, Routing, capacity, kept_choices
from distlab.processes.spawn import spawn

# E = 12 splits over P = 1..4; 96 tokens, top-2: 192 choices, capacity 16 at gamma = 1 (32 dropped).
CFG = MoEConfig(dim=8, heads=2, ffn=16, experts=12, top_k=2, capacity_factor=1.0, aux_weight=0.5, seed=3)
PROBLEM = runs.Problem(n=12, seq=8, seed=5, steps=2, lr=0.1)
CASES = [(1, None), (1, 1.0), (2, None), (2, 1.0)]  # (kappa, gamma): None, no drops
PHASES = ("counts", "dispatch", "combine", "combine backward", "dispatch backward")


def _block(rt, cfg, statistics="global", rule="global"):
    lesson = load_lesson("10_expert_parallel")
    return lesson.parallel_block(rt, cfg, statistics, rule)


def _sync(lesson, block, world, divide_experts=True):
    def sync():
        if divide_experts:
            lesson.average_gradients(block, world)
        else:  # the wrong answer: the experts' gradients left summed over the ranks
            for name, p in block.named_parameters():
                if p.grad is not None and ".experts." not in name:
                    dist.all_reduce(p.grad)
                    p.grad /= world

    return sync


def _everything(rt):
    """Every claim on this rank: name -> bool (and a few measured figures)."""
    from dataclasses import replace

    lesson, p, ok = load_lesson("10_expert_parallel"), rt.world_size, {}
    ways = {
        "lesson": lambda x, s, r: lesson.AllToAll.apply(x, s, r, None, Ledger(), ("f", "b")),
        "torch": lambda x, s, r: funcol.all_to_all_single_autograd(x, r, s, dist.group.WORLD),
        "library": lambda x, s, r: all_to_all(x, s, r),
    }
    for name, way in ways.items():
        ok[f"all-to-all {name} = one process"] = all(check_all_to_all(rt, way))
    for top_k, gamma in CASES:
        cfg = replace(CFG, top_k=top_k, capacity_factor=gamma)
        ref, ref_z = runs.one_process_run(cfg, PROBLEM)
        rows = PROBLEM.rows(rt.rank, p)
        for divide in (True, False):
            block, _ = _block(rt, cfg)
            run, z = runs.split_run(rt, block, cfg, PROBLEM, _sync(lesson, block, p, divide))
            errors, same = runs.differences(ref, ref_z[rows], run, z)
            ok[f"kappa {top_k} gamma {gamma} divide {divide}: = one process"] = same
    # bytes, one forward and backward, against the formula from the reference's decisions
    block, layer = _block(rt, CFG)
    x, target = PROBLEM.batch(CFG.dim, PROBLEM.rows(rt.rank, p))
    runs.loss_of(block(x), target, CFG.aux_weight).backward()
    ref = runs.decisions(CFG, PROBLEM, p)
    formula = cost.expected_bytes(ref.kept_counts, rt.rank, CFG.dim * 8)
    ok["bytes = formula"] = {ph: layer.ledger.sent_in(ph) for ph in PHASES} == formula
    ok["plan keeps the reference's counts"] = torch.equal(layer.plan.kept, ref.kept_counts)
    # the statistics pitfall: L_aux alone, its gradient on the replicated weights
    reference = MoEBlock(CFG)
    reference(PROBLEM.batch(CFG.dim)[0])[1].backward()
    for statistics in ("local", "global"):
        block, _ = _block(rt, CFG, statistics)
        block(x)[1].backward()
        lesson.average_gradients(block, p)
        router = block.moe.router.weight.grad
        ok[f"{statistics} aux gradient = one process"] = torch.allclose(
            router, reference.moe.router.weight.grad, rtol=1e-10, atol=1e-12
        )
        ok[f"{statistics} aux rel diff"] = ((router - reference.moe.router.weight.grad).abs().max()).item()
    # the capacity pitfall: the choices each rule keeps, against the reference's
    share = len(ref.kept) // p
    for rule in ("rank", "global"):
        block, layer = _block(rt, CFG, rule=rule)
        with torch.no_grad():
            block(x)
        got = torch.zeros(share, CFG.top_k, dtype=torch.bool)
        got[layer.plan.tokens, layer.plan.slots] = True
        ok[f"{rule} rule drops what the reference drops"] = torch.equal(
            got, ref.kept[rt.rank * share : (rt.rank + 1) * share]
        )
    return ok


@pytest.fixture(scope="module")
def claims():
    return {p: spawn(_everything, p) for p in (1, 2, 3, 4)}


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_the_all_to_all_lessons_librarys_and_torchs_equal_one_process_forward_and_backward(claims, world):
    for rank in claims[world]:
        assert all(rank[f"all-to-all {who} = one process"] for who in ("lesson", "torch", "library"))


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("top_k,gamma", CASES)
def test_expert_parallelism_equals_one_process(claims, world, top_k, gamma):
    """Output, every gradient (router, experts, attention, LayerNorms), parameters after 2 SGD steps and the
    losses, float64 at rtol 1e-10, with and without drops. And the check fails on a wrong answer: the experts'
    gradients left as the sum over ranks (not divided by P), at P > 1."""
    for rank in claims[world]:
        assert rank[f"kappa {top_k} gamma {gamma} divide True: = one process"]
        assert rank[f"kappa {top_k} gamma {gamma} divide False: = one process"] == (world == 1)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_bytes_per_rank_equal_the_formula_and_the_plan_keeps_the_reference_counts(claims, world):
    for rank in claims[world]:
        assert rank["bytes = formula"] and rank["plan keeps the reference's counts"]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_local_statistics_give_another_gradient_and_the_exchanged_counts_the_exact_one(claims, world):
    for rank in claims[world]:
        assert rank["global aux gradient = one process"]
        assert not rank["local aux gradient = one process"] and rank["local aux rel diff"] > 1e-4


@pytest.mark.parametrize("world", [2, 3, 4])
def test_capacity_counted_per_rank_drops_other_tokens(claims, world):
    ranks = claims[world]
    assert all(rank["global rule drops what the reference drops"] for rank in ranks)
    assert not all(rank["rank rule drops what the reference drops"] for rank in ranks)


def test_at_p1_local_statistics_and_per_rank_capacity_are_the_global_ones(claims):
    (rank,) = claims[1]
    assert rank["local aux gradient = one process"] and rank["rank rule drops what the reference drops"]


def test_the_capacity_rule_and_the_byte_formula_by_hand():
    """Capacity 2 over 5 tokens (kappa = 1): expert 0 keeps tokens 0, 2 and drops 3; expert 1 keeps 1, 4.
    Bytes, P = 2, E = 2 (expert i on rank i), kept = [[2, 1], [0, 1]]: rank 0 sends its one token for expert 1
    away and returns nothing (rank 1 kept none for expert 0); rank 1 sends nothing and returns that token."""
    chosen = torch.tensor([[0], [1], [0], [0], [1]])
    routing = Routing(torch.zeros(5, 2), chosen, torch.ones(5, 1))
    assert kept_choices(routing, 2).flatten().tolist() == [True, True, True, False, True]
    assert kept_choices(routing, None).all()
    assert capacity(CFG, 96) == math.ceil(1.0 * 2 * 96 / 12) == 16
    kept = torch.tensor([[2, 1], [0, 1]])  # rank 0: 2 tokens for expert 0, 1 for expert 1; rank 1: one for expert 1
    assert cost.expected_bytes(kept, 0, 64) == {
        "counts": 2 * 8,  # (P - 1) E int64
        "dispatch": 64,
        "combine": 0,
        "combine backward": 64,
        "dispatch backward": 0,
    }
    assert cost.expected_bytes(kept, 1, 64)["combine"] == 64


def _check(rt, experts, global_batch):
    from types import SimpleNamespace

    load_lesson("10_expert_parallel").world_rules(SimpleNamespace(experts=experts, global_batch=global_batch), 3)


def test_bad_splits_are_refused_on_every_rank_naming_the_flag():
    message = assert_same_error_on_every_rank(_check, 2, 8, 12, match="--experts")
    assert "P = 3" in message and "E = 8" in message
    with pytest.raises(ValueError, match="--global-batch: P = 3 ranks must divide N = 8"):
        _check(None, 12, 8)  # (the same rule, in this process: no collective runs before it)
    assert_flag_refused("10_expert_parallel", "--top-k", "--top-k", "3")
    assert_flag_refused("10_expert_parallel", "--capacity-factor", "--capacity-factor", "0")


def test_the_lesson_passes():
    out = assert_lesson_passes_at_80_columns("10_expert_parallel.py", 4)
    assert "phi: the step's (exchanged)" in out and "dispatch bwd" in out
