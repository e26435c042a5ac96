"""Exercise 07: ZeRO-1 by hand, judged on 3 ranks against one process on the whole batch.

Each rank trains a model with the shapes real models have (`distlab.proof.models.RealShapes`: a parameter on the
root module, an embedding tied to the output layer, a frozen tower and a frozen bias; units of 25, 6 and 31
trained parameters, the root's holding `logit_scale` and the tied weight: uneven shards at P = 3) for 3 AdamW
steps with the answer's ZeRO-1. The lesson's claims: the parameters and AdamW's two moments equal one
process's on all N rows (float64, 1e-10); the weights every rank computes with are the stepped shards,
gathered; each rank sends 2 (P-1) e Psi_P bytes per step (DDP's); and it holds the formula's bytes of each
item (the whole weights and gradients, a P-th of the moments)."""

from pathlib import Path

import torch
from exercise_kit import Exercise, solution
from exercise_signatures import Confined, Equals, Mistake, Scaled

from distlab.data_split.sharding import accounting
from distlab.data_split.sharding.flat import units_of
from distlab.data_split.sharding.problem import ShardingConfig, build_model, reference
from distlab.data_split.sharding.training import run_strategy

LESSON, NAME = "sharding", "zero1"
P, CFG = 3, ShardingConfig(global_batch=6, widths=(6, 5, 6), real_shapes=True)
BEFORE, OTHERS = "the weights before training", "the other ranks' shards"


def _flat(tensors: dict, names: list[str]) -> torch.Tensor:
    return torch.cat([tensors[n].detach().flatten() for n in names])


def _others_mask(model, rank: int) -> dict[str, torch.Tensor]:
    """True on every element of the weights that another rank's shard holds."""
    masks = {}
    for unit in units_of(model, rank, P):
        flat = torch.ones(unit.padded, dtype=torch.bool)
        unit.my_shard(flat).fill_(False)
        masks.update(unit.named(flat))
    return masks


def _watched(zero1, made: list, first: list):
    """The answer's ZeRO-1, with the gradient its shards are stepped with at step 1 kept for the judge."""

    def make(model, rt, cfg):
        z = zero1(model, rt, cfg)
        made.append(z)
        reduce = z.after_backward

        def after_backward():
            reduce()
            if not first:
                first.extend(s.grad.detach().clone() for s in z.shards)

        z.after_backward = after_backward
        return z

    return make


def _ranks(rt, zero1, claims) -> None:
    made, first = [], []
    run = run_strategy(rt, CFG, _watched(zero1, made, first))
    ref, z = reference(CFG), made[0]
    step_one = reference(CFG, steps=1).first_grads
    claims.close(
        "step 1: each shard is stepped with its part of the mean gradient over ranks",
        torch.cat(first),
        torch.cat([u.my_shard(u.flatten([step_one[n] for n in u.names])) for u in z.units]),
        what="shard.grad",
    )
    claims.tensors("the parameters after 3 AdamW steps equal one process's", run.params, ref.params, what="theta")
    names = [n for unit in z.units for n in unit.names]  # the trained parameters, each once
    for key, moment in (("exp_avg", "first"), ("exp_avg_sq", "second")):
        claims.tensors(
            f"AdamW's {moment} moment equals one process's",
            {n: run.states[n][key] for n in names},
            {n: ref.states[n][key] for n in names},
            what=key,
        )
    claims.close(
        "the weights each rank computes with are the stepped shards, gathered",
        _flat(dict(z.model.named_parameters()), names),
        _flat(z.params(), names),
        what="the weights",
        alternatives={BEFORE: _flat(dict(build_model(CFG).named_parameters()), names)},
        regions={OTHERS: _flat(_others_mask(z.model, rt.rank), names)},
    )
    sizes = accounting.Sizes.of(units_of(build_model(CFG), rt.rank, P), P, 8)
    claims.equal(
        "bytes sent per step = 2 (P-1) e Psi_P",
        run.sent,
        accounting.expected_bytes("ZeRO-1", sizes),
        what="bytes the ring sent",
        hints=("one ring reduce-scatter and one ring all-gather per layer per step, through z.ring",),
    )
    claims.equal(
        "bytes held per rank = the formula, item by item",
        run.held,
        accounting.held("ZeRO-1", sizes),
        what="bytes held",
        hints=("ZeRO-1 keeps the whole weights and the whole gradients; only the optimizer states are sharded",),
    )


MISTAKES = (
    Mistake(
        "the sum over ranks, not the mean",
        "each shard is stepped with",
        (Scaled("P", lambda p: p),),
        (
            "AdamW divides most of a factor away, but its moments keep it: what reaches shard.grad?",
            "the reduce-scatter hands rank r shard r of the SUM over ranks; the loss is a mean over all N rows",
            "shard.grad = z.ring.reduce_scatter(flat) / rt.world_size",
        ),
    ),
    Mistake(
        "the stepped shards never gathered",
        "weights each rank computes with",
        (Equals(BEFORE),),
        (
            "the optimizer steps the shards, not the weights: the forward still runs the first weights",
            "after the step, every rank needs every stepped shard back in its whole weights",
            "after_step: for each unit, unit.unflatten(z.ring.all_gather(shard.detach())) copied into "
            "unit.params under no_grad",
        ),
    ),
    Mistake(
        "only this rank's shard copied back",
        "weights each rank computes with",
        (Confined(OTHERS),),
        (
            "your own shard is in place; the other ranks' stepped shards never reached you",
            "each rank stepped one shard: all of them must travel to every rank",
            "copy the all-gather of the stepped shards, not your own shard alone",
        ),
    ),
)


def _lesson_zero1(model, rt, cfg):
    return solution(LESSON, NAME).load()(model, rt, cfg)


def summed(model, rt, cfg):
    """The lesson's ZeRO-1 with the sum over ranks in shard.grad, not the mean."""
    z = _lesson_zero1(model, rt, cfg)
    mean = z.after_backward

    def after_backward():
        mean()
        with torch.no_grad():
            for shard in z.shards:
                shard.grad *= rt.world_size

    z.after_backward = after_backward
    return z


def never_gathered(model, rt, cfg):
    """The shards reduce-scattered and stepped, the weights never updated."""
    z = _lesson_zero1(model, rt, cfg)
    z.after_step = lambda: None
    return z


def own_shard_only(model, rt, cfg):
    """Each rank copies its own stepped shard into its weights, and nothing else."""
    z = _lesson_zero1(model, rt, cfg)

    def after_step():
        with torch.no_grad():
            for unit, shard in zip(z.units, z.shards):
                whole = unit.flatten([p.detach() for p in unit.params])
                unit.my_shard(whole).copy_(shard.detach())
                for p, new in zip(unit.params, unit.unflatten(whole)):
                    p.copy_(new)

    z.after_step = after_step
    return z


def all_reduced(model, rt, cfg):
    """Right numbers, DDP's all-reduce of the whole gradient and then my slice: 1.5 times the bytes."""
    z = _lesson_zero1(model, rt, cfg)

    def after_backward():
        for unit, shard in zip(z.units, z.shards):
            whole = z.ring.all_reduce(unit.flatten([p.grad for p in unit.params]))
            shard.grad = unit.my_shard(whole).clone() / rt.world_size

    z.after_backward = after_backward
    return z


def whole_gradients_freed(model, rt, cfg):
    """Right numbers, the whole gradients dropped after the reduce-scatter: ZeRO-2's memory, not ZeRO-1's."""
    z = _lesson_zero1(model, rt, cfg)
    reduce = z.after_backward

    def after_backward():
        reduce()
        for unit in z.units:
            for p in unit.params:
                p.grad = None

    z.after_backward = after_backward
    return z


# World sizes: P = 3 only: shards uneven and 2 (P-1)/P apart from (P-1) at P = 3; resuming at another P is lesson 07's
# own test.
EXERCISE = Exercise(
    LESSON,
    NAME,
    _ranks,
    P,
    MISTAKES,
    hints=(
        "each rank steps one P-th of the weights; the gradient it needs there is the mean over all ranks",
        "after backward: reduce-scatter each layer's flat gradient into your shard (a mean); after the step: "
        "all-gather the stepped shards back into every rank's weights",
        "shard.grad = z.ring.reduce_scatter(unit.flatten([p.grad for p in unit.params])) / P; after the step "
        "copy unit.unflatten(z.ring.all_gather(shard.detach())) into unit.params",
    ),
    numbers="equal|weights|shard is stepped",
)
WRONG = {
    "the sum over ranks, not the mean": "summed",
    "the stepped shards never gathered": "never_gathered",
    "only this rank's shard copied back": "own_shard_only",
}
test_exercise, test_the_blank_is_not_written_yet, test_the_judge_names_the_mistake = EXERCISE.tests(
    Path(__file__), WRONG
)
test_the_judge_checks_beyond_numbers = EXERCISE.structure_test(
    Path(__file__), {"all_reduced": "bytes sent", "whole_gradients_freed": "bytes held"}
)

test_the_judge_rejects_a_planted_slip = EXERCISE.audit_test(Path(__file__))
test_the_judge_rejects_a_second_slip = EXERCISE.audit_test(Path(__file__), second=True)
