"""Lesson 12: one transformer trained with data, pipeline, tensor and context parallelism at once, on one
DeviceMesh, and exactly equal to one process.

    torchrun --nproc-per-node 8 lessons/12_composed_mesh.py    # --dp 2 --pp 2 --tp 2 --cp 1: P = 8

Every way of splitting training has had a lesson of its own, each on its own toy. A large run uses them at
once, on one model: torchtitan applies FSDP2, tensor, pipeline and context parallelism to one Llama on one
DeviceMesh. Here a small decoder-only transformer (`distlab.composed.model`: an embedding, L of the ground
floor's blocks, a final norm and a head over V tokens) trains on P = dp pp tp cp ranks, and after a few AdamW
steps in float64 its loss, every parameter and every optimizer state equal one process's on the same global
batch (to 1e-10). torchtitan checks its composition by comparing loss curves with 1-D FSDP; in float64 the
composition is exact, so we check that.

The mesh. `init_device_mesh` lays the P ranks out as a pp x dp x cp x tp grid (tp innermost: its ranks are
neighbours; `distlab.composed.config`), and `mesh[dim].get_group()` is the group of ranks that differ only in
`dim`. Each parallelism runs its collectives on its own dimension's group, and only there:

    pp      torch's PipelineStage and Schedule1F1B over the pp group: activations forward, their gradients
            back, n (s / tp) d e per micro-batch (sequence parallelism cuts the message by tp)
    tp      parallelize_module with lesson 08's plan, sequence parallel (f-bar, g-bar), and the embedding's
            rows, the final norm and the head; DTensor derives the all-gathers and reduce-scatters. The
            LayerNorms' gains and biases are replicated, but each tp rank normalised only its s / tp
            positions: their gradients are partial sums, all-reduced over tp after the last backward (the
            table's "tp gradients all_reduce": 2 (tp-1)/tp x 4 vectors of d a block, 2 more for the final
            norm, x e; 2,048 bytes on the first of 2 x 2 x 2 x 1's stages: 1 x 8 x 32 x 8)
    cp      lesson 09's ring over the cp group (`distlab.layer_split.context_parallel.ring_attention`), the block's
            attention core
    dp x cp FSDP2 over the two flattened into one dimension of W = dp cp ranks: they hold the same weights
            and split the batch (dp by sequences, cp by positions), so their gradients are averaged together

Why each is torch's own or ours. The pipeline is torch's: its stages take any module (token ids in, logits
out, the loss per micro-batch) on a sub-group of the mesh, and its schedule drives FSDP2 (no reduce-scatter
until the last backward; lesson 04 showed its 1F1B runs our order); our runner (lessons 01-05) is built
around one MLP on the world group. Tensor parallelism is torch's (lesson 08 proved parallelize_module equal
to ours). Context parallelism is ours: torch 2.13's context_parallel replaces the CUDA attention kernels
(flash, efficient, cuDNN) and not the CPU one, so on gloo the ring is lesson 09's.

Why the sum comes out exact. A rank's loss is the mean over its own tokens, and every rank has as many: the
global mean is the mean over dp and cp of the ranks' means, the tp ranks of one (dp, cp) agreeing. So the
gradient of the global loss is (1 / M) sum over micro-batches (the schedule's scale_grads), averaged over the
W ranks (FSDP2's reduce-scatter); tensor and context parallelism compute each rank's share exactly (lessons
08, 09). One catch, AdamW's: a parameter whose true gradient is zero sees only rounding, which AdamW divides by
sqrt(v) + eps and turns into a step; the k projection's bias is such a parameter, and the model drops it.

Each step is measured (`distlab.composed.measure`): bytes per dimension at each point of the step, the
activations autograd keeps and the model states, each against its closed form (`distlab.composed.cost`, built
from lessons 07-09's formulas). Context parallelism cuts a rank's positions by cp, but at a fixed P a cp bought
by halving dp doubles each rank's micro-batch n = N / (dp M): n s is unchanged, and 2 x 2 x 2 x 1 and
1 x 2 x 2 x 2 keep the same activation peak. cp shrinks activations when it is added beside dp, or when one
sequence is too long for a rank at n = 1. Then a distributed checkpoint (`distlab.composed.checkpoint`) saved at this
shape resumes at the same shape, bit-identical, and at another (dp pp x 1 x tp x cp), to float64 rounding.
"""

from __future__ import annotations

import functools
import logging
import warnings
from contextlib import nullcontext
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

from distlab.comm.agree import rank_table
from distlab.comm.ring import Ring
from distlab.composed import checkpoint, cost
from distlab.composed.config import RunConfig, check_model, check_shape, describe, folded, small_shapes
from distlab.composed.dims import LAYOUT, ParallelDims
from distlab.composed.measure import StepMeasured, held, measuring
from distlab.composed.model import LanguageModel, entropy_rate, keep_stage, loss_fn, token_batch
from distlab.composed.trainee import MeshTrainee, flat_states
from distlab.layer_split.context_parallel.ring_attention import ring_core
from distlab.layer_split.context_parallel.split import Layout, pieces_of
from distlab.layer_split.tensor_parallel.torch_tp import plan as block_plan
from distlab.processes.console import print0, rows_table
from distlab.processes.flags import (
    add_global_batch,
    check_flags_against_world,
    checkpoint_dir,
    positive_float,
    positive_int,
    require,
)
from distlab.processes.identity import Runtime
from distlab.processes.runtime import distributed, run_main
from distlab.processes.scratch import scratch_dir
from distlab.proof.cli import lesson_parser
from distlab.proof.compare import Comparison, all_ok, compare
from distlab.proof.reference import one_process
from distlab.proof.sizes import Transformer
from distlab.proof.training import Run, train
from distlab.proof.verdict import Verdict

# torch's notes that are not this lesson's: the stage's logits are a view (the schedule never writes into
# them), and gathering a parameter FSDP2 and tp both cut (for the comparison, once a step) takes two steps
warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)

# ---- the mechanism: the mesh, its groups, and four parallelisms applied to one model -------------

SCRATCH = "distlab12-"  # the prefix of the lesson's own checkpoint directory (the system's temporary one)


def make_mesh(rt: Runtime, shape: ParallelDims) -> tuple[DeviceMesh, DeviceMesh]:
    """The 4-D mesh (pp, dp, cp, tp outermost first) and its dp x cp ranks flattened into one dimension."""
    mesh = init_device_mesh(rt.device.type, tuple(getattr(shape, d) for d in LAYOUT), mesh_dim_names=LAYOUT)
    return mesh, mesh["dp", "cp"]._flatten("dp_cp")  # FSDP2 shards over both: they hold the same weights


def positions(cfg: RunConfig, shape: ParallelDims, at: dict[str, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(the positions of this rank's tokens: its cp rank's zig-zag pieces; the part of them its tp rank's
    embedding output holds under sequence parallelism)."""
    mine = torch.cat([torch.arange(r.start, r.stop) for r in pieces_of(at["cp"], shape.cp, cfg.seq, "zigzag")])
    return mine, mine.chunk(shape.tp)[at["tp"]]


EDGES = {  # the embedding, the final norm and the head under tensor + sequence parallelism
    "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),  # vocab rows; out cut along seq
    "norm": SequenceParallel(),
    "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),  # vocab rows; logits gathered
}


def parallelize(model: LanguageModel, cfg: RunConfig, shape: ParallelDims, mesh: DeviceMesh, shards: DeviceMesh):
    """The composition, one dimension at a time, on this rank's copy of the whole model."""
    at = {d: mesh.get_local_rank(d) for d in LAYOUT}
    keep_stage(model, at["pp"], shape.pp)  # pp: this rank's blocks (and the embedding, or the norm and head)
    model.place(positions(cfg, shape, at)[1])
    if shape.cp > 1:  # cp: attention by the ring over the cp group, on the zig-zag pieces
        core = ring_core(Ring(mesh.get_group("cp")), Layout(shape.cp, cfg.seq, "zigzag", causal=True))
        for block in model.layers.values():
            block.attn.core = core
    if shape.tp > 1:  # tp: DTensors on the tp group; f-bar, g-bar derived from their placements
        for block in model.layers.values():
            parallelize_module(block, mesh["tp"], block_plan(sequence_parallel=True))
        parallelize_module(model, mesh["tp"], {k: v for k, v in EDGES.items() if getattr(model, k) is not None})
    # dp x cp: FSDP2, a unit per block, then the rest; kept gathered from the first micro-batch's forward to
    # the last one's backward (else every micro-batch would gather every unit again)
    for block in model.layers.values():
        fully_shard(block, mesh=shards, reshard_after_forward=False)
    return fully_shard(model, mesh=shards, reshard_after_forward=False)


class MeshStep:
    """This rank's stage of the model on the mesh (composed by `build`), AdamW on its shards, and torch's 1F1B
    over the pp group; `step(k)` runs step k's micro-batches (a `training.Step`: this rank's loss, None off
    the last stage)."""

    def __init__(self, rt: Runtime, cfg: RunConfig, shape: ParallelDims, build=parallelize):
        self.cfg, self.shape, self.device = cfg, shape, rt.device
        self.mesh, self.shards = make_mesh(rt, shape)
        self.at = {d: self.mesh.get_local_rank(d) for d in LAYOUT}
        self.groups = {d: self.mesh.get_group(d) for d in LAYOUT} | {"dp_cp": self.shards.get_group()}
        model = build(LanguageModel(cfg).to(rt.device), cfg, shape, self.mesh, self.shards)
        self.stage = PipelineStage(model, self.at["pp"], shape.pp, rt.device, group=self.groups["pp"])
        self.schedule = Schedule1F1B(self.stage, cfg.micro_batches, loss_fn=loss_fn)  # gradients / M at the end
        self.trainee = MeshTrainee(model, torch.optim.AdamW(model.parameters(), lr=cfg.lr))
        self.first, self.last = self.at["pp"] == 0, self.at["pp"] == shape.pp - 1

    def share(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Step k's tokens and targets on this rank: its dp rows, its cp positions (every tp rank all of them)."""
        tokens, targets = token_batch(self.cfg, k)
        rows = tokens.shape[0] // self.shape.dp
        mine, cols = (
            slice(self.at["dp"] * rows, (self.at["dp"] + 1) * rows),
            positions(self.cfg, self.shape, self.at)[0],
        )
        return tokens[mine][:, cols].to(self.device), targets[mine][:, cols].to(self.device)

    def step(self, k: int) -> torch.Tensor | None:
        tokens, targets = self.share(k)
        losses: list[torch.Tensor] = []
        inputs = (tokens,) if self.first else ()
        self.schedule.step(*inputs, **(dict(target=targets, losses=losses) if self.last else {}))
        return torch.stack(losses).mean() if self.last else None  # equal micro-batches: the mean of means

    def global_losses(self, losses: list[float], steps: int) -> list[float]:
        """Each step's loss over the whole batch: the mean over dp x cp of the last stage's ranks' means."""
        mine = losses if self.last and self.at["tp"] == 0 else [0.0] * steps
        every = torch.tensor(mine, dtype=torch.float64, device=self.device)
        dist.all_reduce(every)
        return (every / self.shape.shards).tolist()


def train_shape(rt: Runtime, cfg: RunConfig, shape: ParallelDims, save_to: str | None = None, build=parallelize):
    """cfg.steps AdamW steps at `shape` composed by `build` (the exercise's judge passes the learner's), step 2
    measured; with `save_to`, a checkpoint before the last step."""
    mesh_step, measured = MeshStep(rt, cfg, shape, build), {}

    def step(k: int):
        if k != 1:
            return mesh_step.step(k)
        with measuring(mesh_step, {d: mesh_step.groups[d] for d in SENDING}) as measured["step"]:
            return mesh_step.step(k)

    trainee, before = mesh_step.trainee, cfg.steps - 1
    first = train(trainee, step, before, keep_states=True)
    if save_to is not None:
        checkpoint.save(save_to, trainee.model, trainee.optimizer)
    last = train(trainee, lambda k: step(before + k), 1, keep_states=True)
    run = replace(
        last, first_grads=first.first_grads, losses=mesh_step.global_losses(first.losses + last.losses, cfg.steps)
    )
    return ShapeRun(shape, mesh_step, run, measured["step"], held(trainee.model, trainee.optimizer))


@dataclass
class ShapeRun:
    """One shape's training: the step object, the loop's record (global losses), step 2 measured, and the
    model states this rank held after the last step."""

    shape: ParallelDims
    mesh_step: MeshStep
    run: Run
    measured: StepMeasured
    states: dict[str, int]


# ---- the chapter, part by part -------------------------------------------------------------------


def reference(cfg: RunConfig) -> Run:
    """One process, the whole model on every step's whole batch: plain autograd, torch's AdamW."""
    optimizer = functools.partial(torch.optim.AdamW, lr=cfg.lr)
    return one_process(LanguageModel(cfg), lambda k: token_batch(cfg, k), loss_fn, optimizer, cfg.steps, True)


def against(ref: Run, run: Run) -> dict[str, list[Comparison]]:
    """This rank's parameters (after the last step), step 1's gradients and AdamW's states, by name, against
    one process's of the same names (a rank holds its stage's)."""
    mine, states = set(run.params), flat_states(ref.states)
    return {
        "params": compare({n: ref.params[n] for n in mine}, run.params),
        "grads": compare({n: ref.first_grads[n] for n in run.first_grads}, run.first_grads),
        "states": compare({k: v for k, v in states.items() if k.split()[0] in mine}, flat_states(run.states)),
    }


def show_mesh(rt: Runtime, mesh_step: MeshStep, verdict: Verdict) -> None:
    shape = mesh_step.shape
    print0(f"\n[bold]2. The mesh it ran on: {shape} (dp x pp x tp x cp), laid out pp x dp x cp x tp[/]")
    rows = []
    for r in range(rt.world_size):
        at = shape.coordinates(r)
        rows.append((str(r), " ".join(str(at[d]) for d in LAYOUT), *(shape.members(r, d) for d in GROUPS)))
    print0(rows_table("", ("rank", "pp dp cp tp", *(f"{d} group" for d in GROUPS)), rows))
    real = {d: dist.get_process_group_ranks(mesh_step.groups[d]) for d in GROUPS}
    verdict.check(
        "each group of the mesh = the ranks that differ in that dimension only",
        all(",".join(map(str, real[d])) == shape.members(rt.rank, d) for d in GROUPS),
    )


GROUPS = ("tp", "cp", "dp", "pp", "dp_cp")
SENDING = ("tp", "cp", "pp", "dp_cp")  # (the dp group itself carries nothing: FSDP2 runs on dp x cp)


def show_training(rt: Runtime, cfg: RunConfig, shapes: list[ParallelDims], ref: Run, verdict: Verdict, path: str):
    print0(f"\n[bold]1. {cfg.steps} AdamW steps at each shape of P = {rt.world_size}, against one process[/]")
    runs, rows = {}, []
    for shape in shapes:
        runs[shape] = one = train_shape(rt, cfg, shape, save_to=path if shape == shapes[0] else None)
        found = against(ref, one.run)
        loss = max(abs(a - b) for a, b in zip(one.run.losses, ref.losses))
        worst = [loss] + [max((c.max_rel for c in found[k]), default=0.0) for k in ("params", "grads", "states")]
        worst = rank_table(worst, rt.device).max(0).values.tolist()  # the worst rank's
        ok = loss < 1e-10 and all(all_ok(found[k]) for k in found)
        verdict.check(f"{shape}: loss, parameters, gradients, AdamW states = one process (1e-10)", ok)
        rows.append((str(shape), *(f"{w:.0e}" for w in worst), MARK[ok]))
    print0(
        rows_table(
            "The worst rank's largest difference (parameters, gradients, states: relative)",
            ("shape", "loss", "params", "step 1 grads", "AdamW states", "="),
            rows,
        )
    )
    print0(f"losses: {', '.join(f'{x:.6f}' for x in ref.losses)} (floor: {entropy_rate(cfg):.4f})", highlight=False)
    verdict.figure("losses", ref.losses)
    return runs


MARK = {True: "[green]yes[/]", False: "[bold red]NO[/]"}  # the tables' last column


def show_communication(rt: Runtime, cfg: RunConfig, one: ShapeRun, verdict: Verdict) -> None:
    shape, at = one.shape, one.mesh_step.at
    print0(f"\n[bold]3. What rank {rt.rank} sends in one step at {shape}, by dimension, against the formulas[/]")
    expected = cost.expected_sent(cfg, shape, place_of(one.mesh_step))
    rows = [
        (dim, phase, kind, f"{one.measured.sent.get((dim, phase, kind), 0):,}", f"{int(v):,}")
        for (dim, phase, kind), v in sorted(expected.items(), key=lambda kv: (GROUPS.index(kv[0][0]), kv[0][1]))
    ]
    coordinates = ", ".join(f"{d} {at[d]}" for d in LAYOUT)
    print0(
        rows_table(
            f"rank {rt.rank} ({coordinates}), step 2, bytes", ("dim", "phase", "collective", "sent", "formula"), rows
        )
    )
    verdict.check(f"{shape}: bytes per rank and step = the formulas, every dimension", one.measured.sent == expected)


def place_of(mesh_step: MeshStep) -> cost.Place:
    return cost.Place(mesh_step.at["pp"], mesh_step.shards.get_local_rank())


def show_memory(rt: Runtime, cfg: RunConfig, runs: dict[ParallelDims, ShapeRun], verdict: Verdict) -> None:
    print0("\n[bold]4. Per rank and step: model states, activations, bytes sent; measured = formula[/]")
    rows, figures = [], {}
    for shape, one in runs.items():
        place = place_of(one.mesh_step)
        states, sent = cost.expected_states(cfg, shape, place), cost.expected_sent(cfg, shape, place)
        activations = cost.expected_activations(cfg, shape, place.stage)
        ok = one.states == states and one.measured.activations == activations and one.measured.sent == sent
        verdict.check(f"{shape}: model states, activations (one micro-batch, peak) = formulas", ok)
        by_dim = [sum(v for k, v in one.measured.sent.items() if k[0] == d) for d in SENDING]
        mine = [sum(one.states.values()), *one.measured.activations, *by_dim]
        every = rank_table(mine, rt.device).long().tolist()
        figures[str(shape)] = {"ranks": every, "columns": ["states", "activations", "peak", *SENDING]}
        worst = [max(row[i] for row in every) for i in range(len(mine))]
        rows.append((str(shape), f"{worst[0]:,}", f"{worst[2]:,}", *(f"{w // 1024:,}" for w in worst[3:7])))
    print0(
        rows_table(
            "The largest over the ranks: states and peak activations in bytes, sent in KiB",
            ("shape", "states", "act. peak", *SENDING),
            rows,
        )
    )
    print0("(dp_cp: FSDP2's group; the formulas: distlab/composed/cost.py)", highlight=False)
    verdict.figure("per_rank", figures)


def show_resume(rt: Runtime, cfg: RunConfig, one: ShapeRun, other: ParallelDims, path: str, ref: Run, verdict: Verdict):
    shapes = [one.shape] + ([other] if other != one.shape else [])
    print0(
        f"\n[bold]5. A checkpoint saved at {one.shape} after step {cfg.steps - 1} (torch.distributed.checkpoint), "
        f"resumed at {' and at '.join(map(str, shapes))} for the last step[/]"
    )
    rows = []
    for shape in shapes:
        run = resumed(rt, cfg, shape, path)
        if shape == one.shape:  # the same ranks hold the same names: compare bit for bit
            same = all(torch.equal(run.params[n], one.run.params[n]) for n in run.params) and all(
                torch.equal(a, b)
                for a, b in zip(flat_states(run.states).values(), flat_states(one.run.states).values())
            )
            verdict.check(f"resumed at {shape}: bit-identical to the uninterrupted run", same)
            rows.append((str(shape), "bit-identical" if same else "differs", MARK[same]))
            continue
        found = against(ref, replace(run, first_grads={}))  # step 1's gradients were not resumed
        ok = all_ok(found["params"]) and all_ok(found["states"])
        worst = rank_table([max(c.max_rel for c in found["params"] + found["states"])], rt.device).max().item()
        verdict.check(f"resumed at {shape}: parameters, AdamW states = one process (1e-10)", ok)
        rows.append((str(shape), f"{worst:.0e} from one process", MARK[ok]))
    print0(rows_table("After the last step", ("resumed at", "parameters, AdamW states", "="), rows))


def resumed(rt: Runtime, cfg: RunConfig, shape: ParallelDims, path: str) -> Run:
    """A fresh model and optimizer at `shape`, loaded from the checkpoint, trained for the last step."""
    again = MeshStep(rt, cfg, shape)
    checkpoint.load(path, again.trainee.model, again.trainee.optimizer)
    return train(again.trainee, lambda k: again.step(cfg.steps - 1 + k), 1, keep_states=True)


def parse_args():
    parser = lesson_parser(__doc__)
    for dim, what in (("dp", "data"), ("pp", "pipeline"), ("tp", "tensor"), ("cp", "context")):
        parser.add_argument(
            f"--{dim}", type=positive_int, default=1 if dim == "cp" else 2, help=f"{what}-parallel degree"
        )
    parser.add_argument(
        "--shapes",
        default=None,
        help="more shapes for the tables, e.g. 2x2x1x2,1x2x2x2 (default: "
        "every shape of P with degrees 1 or 2; '' for none)",
    )
    parser.add_argument(
        "--resume-shape", default=None, help="where the checkpoint resumes (default: dp pp x 1 x tp x cp)"
    )
    add_global_batch(parser, 8)
    parser.add_argument("--micro-batches", type=positive_int, default=2, help="micro-batches per step, M (>= pp)")
    parser.add_argument("--seq-len", type=positive_int, default=16, help="tokens per sequence, seq")
    parser.add_argument("--layers", type=positive_int, default=4, help="transformer blocks L")
    parser.add_argument("--dim", type=positive_int, default=32, help="model width d")
    parser.add_argument("--heads", type=positive_int, default=4, help="attention heads h")
    parser.add_argument("--ffn-width", type=positive_int, default=64, help="MLP hidden width d_ff")
    parser.add_argument("--vocab", type=positive_int, default=32, help="vocabulary size V")
    parser.add_argument(
        "--steps",
        type=positive_int,
        default=3,
        help="AdamW steps, at least 2 (step 2 measured; a checkpoint before the last)",
    )
    parser.add_argument("--lr", type=positive_float, default=1e-2, help="AdamW learning rate")
    parser.add_argument(
        "--checkpoint-dir",
        metavar="DIR",
        type=checkpoint_dir,
        help="where part 5 saves (kept); default a temporary one, removed however the run ends",
    )
    return parser.parse_args()


def run_config(args) -> RunConfig:
    model = Transformer(args.layers, args.dim, args.heads, args.ffn_width, args.vocab, key_bias=False)
    return RunConfig(model, args.seq_len, args.global_batch, args.micro_batches, args.steps, args.lr, args.seed)


def shapes_of(args, world_size: int) -> tuple[list[ParallelDims], ParallelDims]:
    """(the flags' shape first, then the --shapes ones; the shape the checkpoint resumes at)."""
    shape = ParallelDims(args.dp, args.pp, args.tp, args.cp)
    if args.shapes is None:
        more = [s for s in small_shapes(world_size) if s != shape]
    else:
        more = [ParallelDims.parse(text.strip()) for text in args.shapes.split(",") if text.strip()]
    if args.resume_shape is not None:
        return [shape, *more], ParallelDims.parse(args.resume_shape, "--resume-shape")
    return [shape, *more], folded(shape)


def world_rules(args, world_size: int) -> None:
    """Every rule, before any process group: the model's, the flags' shape's (naming --dp .. --cp), each of
    --shapes and the resume shape (naming their flag)."""
    require(args.steps >= 2, "--steps", f"{args.steps} step: at least 2 (step 2 is measured, the last resumed)")
    cfg = run_config(args)
    check_model(cfg)
    shapes, other = shapes_of(args, world_size)
    check_shape(cfg, shapes[0], world_size)
    for shape in shapes[1:]:
        check_shape(cfg, shape, world_size, "--shapes")
    check_shape(cfg, other, world_size, "--resume-shape")


def main() -> int:
    args = check_flags_against_world(parse_args(), world_rules)  # before any process group, every rank alike
    cfg = run_config(args)
    with distributed(args.device, deterministic=True) as rt:  # the same-shape resume is bit-identical
        shapes, other = shapes_of(args, rt.world_size)
        world_rules(args, rt.world_size)  # (outside torchrun the rules wait until here)
        verdict = Verdict(rt)
        print0(
            f"[bold]Lesson 12: one transformer on a dp x pp x tp x cp mesh[/] - P = {rt.world_size}, "
            f"{describe(cfg)}, AdamW, {rt.backend}, float64"
        )
        # The lesson's own directory (no --checkpoint-dir) is removed however the run ends (`scratch_dir`).
        own = rt.is_first and not args.checkpoint_dir
        with scratch_dir(SCRATCH) if own else nullcontext() as scratch:
            path = [args.checkpoint_dir or (str(scratch / "checkpoint") if scratch else None)]
            dist.broadcast_object_list(path, src=0)  # one directory for every rank (one machine)
            ref = reference(cfg)
            runs = show_training(rt, cfg, shapes, ref, verdict, path[0])
            show_mesh(rt, runs[shapes[0]].mesh_step, verdict)
            show_communication(rt, cfg, runs[shapes[0]], verdict)
            show_memory(rt, cfg, runs, verdict)
            show_resume(rt, cfg, runs[shapes[0]], other, path[0], ref, verdict)
            dist.barrier()  # every rank has read it before rank 0 removes it
        return verdict.finish(args.json)


if __name__ == "__main__":
    run_main(main)
