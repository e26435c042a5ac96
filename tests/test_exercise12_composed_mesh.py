"""Exercise 12: the parallelisms placed on the mesh's dimensions, judged on 4 ranks at 1 x 1 x 2 x 2 and at
2 x 2 x 1 x 1 (dp x pp x tp x cp) against one process on the whole batch: at the first the dp x cp group
is the cp group, so an answer that shards over one of them alone passes there; at the second it is dp's,
and the pipeline's stages are cut for real.

Each rank trains the lesson's model composed by the answer for two AdamW steps (the lesson's `train_shape`
with the answer as its `build`) and one process trains the whole model on every step's whole batch
(`lesson.reference`: plain autograd, torch's AdamW). The lesson's claims: every step's loss and every
parameter this rank holds equal one process's (float64, 1e-10), and the bytes sent on each of the tp, cp and
dp x cp groups in the measured step equal the lesson's formulas (the judge counts torch's own collectives by
the group they ran on, `distlab.comm.watch`). Before any step, the model the answer built: tensor parallelism cuts
the parameters the lesson's plan cuts and replicates the rest on tp (what dp x cp cuts said beside it), so a plan
that differs is named before torch's schedule raises on it."""

import re
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from exercise_kit import Exercise
from exercise_signatures import Mistake, Zero
from helpers import load_lesson
from torch.distributed.tensor import DTensor, Shard, placement_types
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from distlab.composed import cost
from distlab.composed.config import MODEL, RunConfig
from distlab.composed.dims import ParallelDims
from distlab.layer_split.tensor_parallel.torch_tp import plan as block_plan
from distlab.proof.models import attention

LESSON, NAME = "12_composed_mesh", "parallelize"
P, SHAPES = 4, (ParallelDims(dp=1, pp=1, tp=2, cp=2), ParallelDims(dp=2, pp=2, tp=1, cp=1))
CFG = RunConfig(replace(MODEL, layers=2), steps=2)
DIMS = {"tp": "tp", "cp": "cp", "dp_cp": "dp x cp"}  # the group's label -> how the claims name it


def _name(shape: ParallelDims) -> str:
    return f"{shape.dp} x {shape.pp} x {shape.tp} x {shape.cp}"


def _ranks(rt, parallelize, claims) -> None:
    lesson = load_lesson(LESSON)
    ref = lesson.reference(CFG)
    for shape in SHAPES:
        _shape(rt, lesson, ref, shape, parallelize, claims)
        if not all(seen.ok for seen in claims.seen):  # a verdict needs the first shape that fails, no more
            return


CUTS = (Shard, getattr(placement_types, "_StridedShard", Shard))  # FSDP2 over tp shards with a stride: a cut too


class _Built(Exception):
    """The model the answer built is not cut as the lesson's plan cuts it: the claim said so, no step is run."""


def _held_on(model, mesh, shards) -> dict[str, dict[str, str]]:
    """Each parameter of the model the answer built: the groups of more than one rank it is a DTensor on, named by
    their ranks ("tp", "dp x cp": the flattened mesh, FSDP2's; "dp", "cp"), each "cut" (a Shard) or "replicated"."""
    named = {tuple(dist.get_process_group_ranks(mesh.get_group(d))): d for d in ("dp", "cp", "tp")}
    named[tuple(dist.get_process_group_ranks(shards.get_group()))] = "dp x cp"
    held = {}
    for name, param in model.named_parameters():
        on = param.device_mesh if isinstance(param, DTensor) else None
        held[name] = {
            named.get(tuple(dist.get_process_group_ranks(on.get_group(i))), f"mesh dim {on.mesh_dim_names[i]}"): (
                "cut" if isinstance(placement, CUTS) else "replicated"
            )
            for i, placement in enumerate(param.placements if on is not None else ())
            if on.size(i) > 1
        }
    return held


def _lesson_cuts(lesson, name: str) -> bool:
    """Whether the lesson's tensor-parallel plan cuts `name` (tp > 1): Colwise all of a module's parameters,
    Rowwise its weight only (the bias added once the partial sums are reduced); the norms none."""
    module, _, kind = name.rpartition(".")
    parts = module.split(".")
    style = (
        block_plan(sequence_parallel=True).get(".".join(parts[2:]))
        if parts[0] == "layers"
        else lesson.EDGES.get(module)
    )
    return isinstance(style, ColwiseParallel) or (isinstance(style, RowwiseParallel) and kind == "weight")


def _listed(names: list[str]) -> str:
    """The names, every block's alike said once ("layers.*.attn.q.weight"), at most 6."""
    names = list(dict.fromkeys(re.sub(r"^layers\.\d+\.", "layers.*.", n) for n in names))
    return ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "") if names else "none"


def _checked(lesson, parallelize, claims, shape: ParallelDims, at: str):
    """The answer as `build`, its model checked as soon as it is built: tensor parallelism cuts what the lesson's
    plan cuts (along any dimension: which is the answer's) and holds the rest replicated on tp, as that plan does;
    said beside it, what FSDP2's dp x cp group cuts. A model placed otherwise stops the shape there, every rank at
    once, before torch's schedule runs it."""

    def built(model, cfg, shape_, mesh, shards):
        model = parallelize(model, cfg, shape_, mesh, shards)
        try:
            held = _held_on(model, mesh, shards)
        except (AttributeError, TypeError):  # no model: the training says what went wrong
            return model
        want = {n for n in held if shape.tp > 1 and _lesson_cuts(lesson, n)}
        got = {n for n, on in held.items() if on.get("tp") == "cut"}
        off = sorted(n for n, on in held.items() if shape.tp > 1 and "tp" not in on and n not in want)
        fsdp = [n for n, on in held.items() if on.get("dp x cp") != "cut"]
        said = [
            f"tp leaves whole {_listed(sorted(want - got))}, which the lesson's plan cuts" if want - got else "",
            f"tp cuts {_listed(sorted(got - want))}, which the lesson's plan leaves whole" if got - want else "",
            f"{_listed(off)} not on tp at all (no DTensor there), which the lesson's plan replicates on tp"
            if off
            else "",
            f"dp x cp (FSDP2) leaves whole {_listed(fsdp)}" if fsdp else "dp x cp (FSDP2) cuts every parameter",
        ]
        note = f"rank {dist.get_rank()}'s model: " + "; ".join(filter(None, said))
        if not claims.holds(
            f"{at}: tensor parallelism cuts the parameters the lesson's plan cuts, the rest replicated on tp",
            got == want and not off,
            what="the model the answer built",
            note=note,
            hints=("tp: every block's plan and the EDGES (embedding, norm, head), parallelize_module on mesh['tp']",),
        ):
            raise _Built
        return model

    return built


def _shape(rt, lesson, ref, shape: ParallelDims, parallelize, claims) -> None:
    at = _name(shape)
    try:
        one = lesson.train_shape(rt, CFG, shape, build=_checked(lesson, parallelize, claims, shape, at))
    except _Built:
        return
    losses = torch.tensor(one.run.losses, dtype=torch.float64)
    claims.close(
        f"{at}: every step's loss equals one process's",
        losses,
        torch.tensor(ref.losses, dtype=torch.float64),
        what="the losses",
    )
    claims.tensors(
        f"{at}: the parameters after the steps equal one process's",
        one.run.params,
        {n: ref.params[n] for n in one.run.params},
        what="the parameters",
    )
    expected = cost.expected_sent(CFG, shape, lesson.place_of(one.mesh_step))
    for dim, named in DIMS.items():
        got = sum(v for k, v in one.measured.sent.items() if k[0] == dim)
        claims.equal(
            f"{at}: bytes sent on the {named} group = the formula",
            got,
            int(sum(v for k, v in expected.items() if k[0] == dim)),
            what=f"bytes this rank sent on its {named} group in step 2",
            note=f"by (phase, collective): {dict((k[1:], v) for k, v in one.measured.sent.items() if k[0] == dim)}",
        )


NUMBERS = "equals one process"
MISTAKES = (
    Mistake(
        "FSDP2 over dp alone",
        "^1 x 1 x 2 x 2: bytes sent on the dp x cp group",
        (Zero(),),
        (
            "the cp ranks hold the same weights as the dp ranks and see other tokens: their gradients must average",
            "shard and reduce over both dimensions at once: the flattened dp x cp mesh",
            "fully_shard(..., mesh=shards) for every block and for the root",
        ),
        fails=(NUMBERS,),
    ),
    Mistake(
        "FSDP2 over cp alone",
        "^2 x 2 x 1 x 1: bytes sent on the dp x cp group",
        (Zero(),),
        (
            "the dp ranks hold the same weights and see other rows of the batch: their gradients must average",
            "at dp = 1 the cp group is the whole dp x cp group, but not at dp = 2: shard over both dimensions",
            "fully_shard(..., mesh=shards) for every block and for the root",
        ),
        fails=(NUMBERS,),
    ),
    Mistake(
        "no ring: each cp rank attends to its own positions only",
        "bytes sent on the cp group",
        (Zero(),),
        (
            "a query must see every earlier key, and under cp the keys are spread over the cp group",
            "the blocks' attention core must be the ring, over mesh's cp group, on the zig-zag layout",
            "block.attn.core = ring_core(Ring(mesh.get_group('cp')), Layout(shape.cp, cfg.seq, 'zigzag', causal=True))",
        ),
        fails=(NUMBERS,),
    ),
)


def _solution():
    return load_lesson(LESSON).parallelize


def fsdp_over_dp_alone(model, cfg, shape, mesh, shards):
    """The dp dimension where dp x cp belongs: at dp = 1 nothing is averaged over the cp ranks."""
    return _solution()(model, cfg, shape, mesh, mesh["dp"])


def fsdp_over_cp_alone(model, cfg, shape, mesh, shards):
    """The cp dimension where dp x cp belongs: right at dp = 1, where the two are one group."""
    return _solution()(model, cfg, shape, mesh, mesh["cp"])


def no_ring(model, cfg, shape, mesh, shards):
    """Everything but context parallelism's ring: each block attends with the plain core, to this rank's
    own positions only."""
    model = _solution()(model, cfg, shape, mesh, shards)
    for block in model.layers.values():
        block.attn.core = attention
    return model


def regathered_every_micro_batch(model, cfg, shape, mesh, shards):
    """Right numbers, more bytes: FSDP2 frees each unit after its forward and gathers it again, per
    micro-batch and in backward."""
    model = _solution()(model, cfg, shape, mesh, shards)
    for module in model.modules():
        if hasattr(module, "set_reshard_after_forward"):
            module.set_reshard_after_forward(True)
    return model


# World sizes: 4 ranks at 1 x 1 x 2 x 2 and 2 x 2 x 1 x 1: the dp x cp group is cp's at the first, dp's at the second.
EXERCISE = Exercise(
    LESSON,
    NAME,
    _ranks,
    P,
    MISTAKES,
    hints=(
        "each parallelism runs its collectives on its own dimension's group of the mesh, and only there",
        "cp: the ring as the blocks' attention core; tp: parallelize_module on mesh['tp']; dp x cp: fully_shard",
        "keep_stage, model.place(positions(...)[1]), ring_core on mesh.get_group('cp'), "
        "parallelize_module(block, mesh['tp'], block_plan(sequence_parallel=True)) and the EDGES, then "
        "fully_shard(block, mesh=shards, reshard_after_forward=False) and the root",
    ),
    numbers=NUMBERS,
)
WRONG = {
    "FSDP2 over dp alone": "fsdp_over_dp_alone",
    "FSDP2 over cp alone": "fsdp_over_cp_alone",
    "no ring: each cp rank attends to its own positions only": "no_ring",
}
test_exercise, test_the_blank_is_not_written_yet, test_the_judge_names_the_mistake = EXERCISE.tests(
    Path(__file__), WRONG
)
test_the_judge_checks_beyond_numbers = EXERCISE.structure_test(
    Path(__file__), {"regathered_every_micro_batch": "bytes sent on the dp x cp group"}
)

test_the_judge_rejects_a_planted_slip = EXERCISE.audit_test(Path(__file__))
test_the_judge_rejects_a_second_slip = EXERCISE.audit_test(Path(__file__), second=True)
