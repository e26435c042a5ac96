"""Exercise 07: ZeRO-1 by hand, judged on 3 ranks against one process on the whole batch.

Each rank trains the lesson's MLP (layers of 221, 154 and 60 parameters: uneven shards at P = 3) for 3
AdamW steps with the answer's ZeRO-1. The lesson's claims: the parameters and AdamW's moments equal one
process's on all N rows (float64, 1e-10), each rank sends 2 (P-1) e Psi_P bytes per step (DDP's), and holds
the formula's bytes of each item."""

from pathlib import Path

import torch
from exercise_kit import Answer, exercise_tests, judge

from distlab.compare import compare
from distlab.sharding import accounting
from distlab.sharding.flat import units_of
from distlab.sharding.problem import ShardingConfig, adamw_reference, build_model
from distlab.sharding.training import run_strategy

LESSON, NAME = "07_sharding", "zero1"
P, CFG = 3, ShardingConfig(global_batch=6)


def _worst(ref: dict, got: dict) -> float:
    return max(row.max_rel for row in compare(ref, got))


def _ranks(rt, zero1, claims) -> None:
    run, ref = run_strategy(rt, CFG, zero1), adamw_reference(CFG)
    err = _worst(ref.params, run.trained.params)
    if not claims.check(
        "the parameters after 3 AdamW steps equal one process's",
        err < 1e-10,
        f"largest relative difference {err:.2e}",
        "reduce-scatter each layer's flat gradient, divide by P, all-gather the stepped shards",
    ):
        return
    moments = {f"{n}.{k}": s[k] for n, s in ref.states.items() for k in ("exp_avg", "exp_avg_sq")}
    err = _worst(moments, {f"{n}.{k}": s[k] for n, s in run.trained.states.items() for k in ("exp_avg", "exp_avg_sq")})
    claims.check(
        "AdamW's moments equal one process's",
        err < 1e-10,
        f"largest relative difference {err:.2e}",
        "shard.grad must be the mean over ranks (sum / P), not the sum",
    )
    sizes = accounting.Sizes.of(units_of(build_model(CFG), rt.rank, P), P, 8)
    want = accounting.expected_bytes("ZeRO-1", sizes)
    claims.check(
        "bytes sent per step = 2 (P-1) e Psi_P",
        run.sent == want,
        f"sent {run.sent}, formula {want}",
        "one ring reduce-scatter and one ring all-gather per layer per step, through z.ring",
    )
    claims.check(
        "bytes held per rank = the formula, item by item",
        run.held == accounting.held("ZeRO-1", sizes),
        f"held {run.held}",
        "keep only the shards' gradients beside the whole ones; make no other copy",
    )


def check(answer: Answer) -> None:
    judge(_ranks, P, answer)


def summed(model, rt, cfg):
    """A wrong answer: the lesson's ZeRO-1 with the sum over ranks in shard.grad, not the mean."""
    z = Answer(Path(__file__).resolve().parent.parent / "lessons" / "07_sharding.py", "zero1").load()(model, rt, cfg)
    mean = z.after_backward

    def after_backward():
        mean()
        with torch.no_grad():
            for shard in z.shards:
                shard.grad *= rt.world_size

    z.after_backward = after_backward
    return z


test_exercise, test_the_judge_rejects_a_blank_and_a_wrong_answer = exercise_tests(
    LESSON, NAME, check, wrong=Answer(Path(__file__), "summed"), wrong_claim="the parameters after 3 AdamW steps"
)
