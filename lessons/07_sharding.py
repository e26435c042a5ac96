"""Lesson 07: what a training step holds, and sharding it: ZeRO-1, -2 and -3 by hand, FSDP2, and a
distributed checkpoint that resumes at another P. After lesson 06, which copied everything to every rank.

    torchrun --nproc-per-node 4 lessons/07_sharding.py     # any P that divides N (24: P = 1..4)

What a step holds. A model of Psi parameters in e-byte elements keeps weights (e Psi), gradients
(e Psi) and AdamW's two moments (2 e Psi): 32 Psi bytes in float64. Under mixed precision: bf16
weights and gradients (2 Psi + 2 Psi), a float32 master copy (4 Psi) that the optimizer steps, and
float32 moments (8 Psi): 16 Psi. Activations, what autograd saves for backward, grow with a rank's
C = N / P rows; the model states do not: under data parallelism every rank holds them whole at any
P. That is where DDP stops scaling, and what ZeRO (Rajbhandari et al., https://arxiv.org/abs/1910.02054)
shards. Layer u's Psi_u parameters form one flat buffer padded to P ceil(Psi_u / P) elements (the pad,
always 0, makes a Psi_u that P does not divide work); rank r owns shard r: Psi_P = sum_u ceil(Psi_u / P)
elements of every sharded item (Psi / P when P divides every Psi_u).

    ZeRO-1  optimizer states sharded: reduce-scatter each layer's gradient (rank r gets shard r of
            the mean), AdamW steps shard r of the weights, all-gather the updated weights
    ZeRO-2  gradients sharded too: each layer's reduce-scatter runs from a hook as soon as backward
            has made its gradient, and the whole gradient is freed
    ZeRO-3  weights sharded too: a forward pre-hook all-gathers a layer just before it runs, a
            forward hook frees it; backward gathers it again (saved-tensor hooks keep only where each
            weight was); the all-gather's backward is the reduce-scatter

Per rank, after a step: DDP e Psi + e Psi + 2 e Psi; ZeRO-1 e Psi + (e Psi + e Psi_P) + 2 e Psi_P
(+ the shard it steps, e Psi_P); ZeRO-2 e Psi + e Psi_P + 2 e Psi_P (+ e Psi_P); ZeRO-3 4 e Psi_P.
Under mixed precision the same stages, the shards bf16, AdamW stepping a float32 master of each (e = 2,
moments and master e_m = 4): DDP 16 Psi; ZeRO-1 4 Psi + 16 Psi_P; ZeRO-2 2 Psi + 16 Psi_P; ZeRO-3 16 Psi_P.
Bytes each rank sends per step (rings, lesson 06): DDP's all-reduce 2 (P-1) e Psi_P; ZeRO-1 and -2 a
reduce-scatter and an all-gather, the same; ZeRO-3 two all-gathers and a reduce-scatter, 1.5x, less
g_0 = (P-1) e ceil(Psi_0 / P): backward never reads the first layer's weights (its input needs no
gradient), so it is not gathered again. `distlab/data_split/sharding/accounting.py` holds every formula.

The shapes real models have. Every stage starts from rank 0's weights and buffers (`Sharded` broadcasts
them). A unit is the trainable parameters a child alone holds; one held by the model itself (`logit_scale`)
or by two children (a tied embedding and output) is in the root's unit, which ZeRO-3 gathers for the whole
forward: a tied weight is one shard, reduced and stepped once. Frozen parameters are no unit's (whole, never
stepped or decayed). A unit no rank used (a branch not taken) keeps no gradient, as in one process; one half
used is refused by name. Any torch.optim class (`ShardingConfig.optimizer`); `ShardingConfig.compute`: ZeRO-3
and FSDP2 compute in bf16 over float32 shards and gradients (tests/test_real_shapes.py proves each shape).

FSDP2 (`fully_shard`) is ZeRO-3 in PyTorch: same gradients, same states (`distlab/data_split/sharding/fsdp.py`
maps its options onto the stages). `torch.distributed.checkpoint` saves its shards from every rank
and loads them into any other sharding: saved at P, resumed at P (bit-identical) and at P / 2 (equal
to float64 rounding), both against a run that never stopped.

A checkpoint directory must be trusted: `dcp.load` unpickles the directory's `.metadata` file, and an
unpickled file can run any code it names. Load only directories this run (or someone you trust) wrote;
`--checkpoint-dir` is for that, never for a directory downloaded or shared by others.
"""

from __future__ import annotations

import functools
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.autograd.graph import saved_tensors_hooks

from distlab.data_split.sharding import accounting, holds
from distlab.data_split.sharding.dcp_resume import save_and_resume
from distlab.data_split.sharding.flat import units_of
from distlab.data_split.sharding.fsdp import Fsdp2, fsdp_held, show_reshard
from distlab.data_split.sharding.problem import ShardingConfig, build_model, global_batch, reference, rows_of
from distlab.data_split.sharding.replicated import Replicated
from distlab.data_split.sharding.report import agreement_table, bytes_table, holds_table, memory_table
from distlab.data_split.sharding.shards import Sharded, no_gradient
from distlab.data_split.sharding.training import run_strategy
from distlab.processes.console import print0, rows_table
from distlab.processes.flags import (
    add_global_batch,
    check_flags_against_world,
    checkpoint_dir,
    divides_global_batch,
    positive_float,
)
from distlab.processes.identity import Runtime
from distlab.processes.runtime import distributed, run_main
from distlab.processes.scratch import scratch_dir
from distlab.proof.cli import add_optimizer_args, lesson_parser
from distlab.proof.compare import against, all_ok, compare
from distlab.proof.launch_count import LaunchCount
from distlab.proof.models import Block, BlockOptions, token_batch
from distlab.proof.verdict import Verdict

# ---- the mechanism: ZeRO-1, -2 and -3 by hand ----------------------------------------------------
# `Sharded` (distlab/data_split/sharding/shards.py) holds what all three share: rank 0's weights broadcast, the flat
# units (`unit.params`: what a unit trains), this rank's shard of each, the optimizer on them, a counting ring.
# The loop, the library's one (`distlab.proof.training.train`), which the one-process reference runs too:
# zero_grad(); loss.backward(); after_backward(); optimizer.step(); after_step().


def zero1(model, rt: Runtime, cfg: ShardingConfig) -> Sharded:
    """Optimizer states sharded; every rank keeps the whole weights and the whole gradient."""
    z = Sharded(model, rt, cfg)

    def after_backward():  # shard r of each unit's mean gradient, to rank r
        for unit, shard in zip(z.units, z.shards):
            grads = [p.grad for p in unit.params]
            if not no_gradient(unit, grads):  # a branch not taken keeps no gradient, as in one process
                shard.grad = z.ring.reduce_scatter(unit.flatten(grads)) / rt.world_size

    def after_step():  # every rank's stepped shard, all-gathered into the whole weights
        with torch.no_grad():
            for unit, shard in zip(z.units, z.shards):
                for p, new in zip(unit.params, unit.unflatten(z.ring.all_gather(shard.detach()))):
                    p.copy_(new)

    z.after_backward, z.after_step = after_backward, after_step
    return z


def zero2(model, rt: Runtime, cfg: ShardingConfig) -> Sharded:
    """ZeRO-1, with each unit's gradient reduce-scattered from backward itself and freed at once."""
    z = zero1(model, rt, cfg)

    def grad_ready(unit, shard, _):
        if all(q.grad is not None for q in unit.params):  # the unit's whole gradient is in
            shard.grad = z.ring.reduce_scatter(unit.flatten([q.grad for q in unit.params])) / rt.world_size
            for q in unit.params:
                q.grad = None  # freed: only the shard stays

    def after_backward():  # the reduce-scatters ran during backward; a unit left half done is refused
        for unit, shard in zip(z.units, z.shards):
            if shard.grad is None:
                no_gradient(unit, [q.grad for q in unit.params])

    for unit, shard in zip(z.units, z.shards):
        for p in unit.params:
            p.register_post_accumulate_grad_hook(functools.partial(grad_ready, unit, shard))
    z.after_backward = after_backward
    return z


class GatherLayer(torch.autograd.Function):
    """Forward: all-gather unit i's shards into its whole flat weights, in the compute dtype. Backward:
    reduce-scatter the whole flat gradient in the shards' dtype, / P: this rank's shard of the mean gradient."""

    @staticmethod
    def forward(ctx, shard, z, i):
        ctx.z, ctx.i = z, i
        return z.ring.all_gather(shard.detach().to(z.compute))

    @staticmethod
    def backward(ctx, grad):
        z = ctx.z
        z.again.pop(ctx.i, None)  # the unit's backward is over: free what was gathered for it
        return z.ring.reduce_scatter(grad.to(z.shards[ctx.i].dtype).contiguous()) / z.rt.world_size, None, None


def zero3(model, rt: Runtime, cfg: ShardingConfig) -> Sharded:
    """Weights sharded too: each unit is whole only while its module's forward or backward runs (the root's:
    the whole forward). `cfg.compute` (bf16): gathered and computed in it; shards and gradients keep theirs."""
    z = Sharded(model, rt, cfg)
    z.whole_weights, z.compute = False, cfg.compute or z.shards[0].dtype
    z.again, z.live, z.hooks = {}, {}, {}  # unit: gathered again; gathered storage: unit; unit: its hooks

    def pack(t):  # a gathered weight is not kept for backward, only which unit and where in it
        i = z.live.get(t.untyped_storage().data_ptr())
        return t if i is None else (i, t.shape, t.stride(), t.storage_offset())

    def unpack(saved):  # backward's first use of a unit's weights gathers them again
        if isinstance(saved, torch.Tensor):
            return saved
        i, *where = saved
        if i not in z.again:
            z.again[i] = z.ring.all_gather(z.shards[i].detach().to(z.compute))
        return z.again[i].as_strided(*where)

    def gather(i, places, module, args):  # forward pre-hook
        whole = GatherLayer.apply(z.shards[i], z, i)
        for spots, view in zip(places, z.units[i].unflatten(whole)):
            for owner, name in spots:  # a tied weight: the same view in every module that holds it
                setattr(owner, name, view)
        z.live[whole.untyped_storage().data_ptr()] = i
        z.hooks[i] = saved_tensors_hooks(pack, unpack)
        z.hooks[i].__enter__()

    def free(i, places, module, args, out):  # forward hook: nothing refers to the whole weights any more
        z.hooks.pop(i).__exit__(None, None, None)
        z.live = {at: j for at, j in z.live.items() if j != i}
        for owner, name in (spot for spots in places for spot in spots):
            setattr(owner, name, None)

    for i, unit in enumerate(z.units):
        places = [[(m, n) for m in model.modules() for n, q in m._parameters.items() if q is p] for p in unit.params]
        for owner, name in (spot for spots in places for spot in spots):
            del owner._parameters[name]  # the whole weights are gone; the shard is all that is left
        unit.params = []  # not even the unit keeps them: ZeRO-3 holds the shard alone, the model's parameter
        model.register_parameter(f"zero3_shard{i}", z.shards[i])  # model.parameters(): what the rank holds
        module = model.get_submodule(unit.where)  # "" is the model itself
        module.register_forward_pre_hook(functools.partial(gather, i, places))
        module.register_forward_hook(functools.partial(free, i, places))
    if cfg.compute is not None:  # floating inputs cast as FSDP2 does; frozen weights, only computed with, too
        for p in z.frozen.values():
            p.data = p.data.to(cfg.compute)
        model.register_forward_pre_hook(
            lambda m, args: tuple(a.to(cfg.compute) if a.is_floating_point() else a for a in args)
        )
    return z


BY_HAND = {"ZeRO-1": zero1, "ZeRO-2": zero2, "ZeRO-3": zero3}
SCRATCH = "distlab07-"  # the prefix of the lesson's own checkpoint directory (the system's temporary one)
RTOL_MIXED, ATOL_MIXED = 2e-2, 1e-3  # mixed against one process: a few bf16 roundings (2^-8) of other sums
BLOCK = BlockOptions(fused_qkv=True, sdpa=False)  # one qkv product; attention written out, its weights saved


# ---- the chapter, part by part -------------------------------------------------------------------


def show_holds(rt: Runtime, cfg: ShardingConfig, verdict: Verdict) -> None:
    c = cfg.global_batch // rt.world_size
    print0(f"\n[bold]1. What a step holds on each rank (data parallel, C = {c} rows), in KiB[/]")
    seq, d, heads = 8, 16, 2  # the block: x is (C, seq, d), h = 2 heads
    models = {  # name: (builder, the global batch, activation bytes at e bytes per element)
        f"MLP {'-'.join(map(str, cfg.widths))}": (
            lambda: build_model(cfg).to(rt.device),
            global_batch(cfg, 0),
            lambda e: accounting.mlp_activations(c, cfg.widths, e),
        ),
        f"block d={d} h={heads} seq={seq}": (
            lambda: Block(d, heads, 4 * d, BLOCK).to(rt.device),
            token_batch(cfg.global_batch, seq, d, 0, cfg.dtype),
            lambda e: accounting.block_activations(
                c, seq, d, heads, e, accounting.layer_norm_stat_bytes(e, rt.device.type)
            ),
        ),
    }
    for name, (build, batch, activations) in models.items():
        x, target = (rows_of(t, rt) for t in batch)
        plain, mixed = holds.measure_one_dtype_step(build, x, target), holds.measure_mixed_step(build, x, target)
        psi, tensors = sum(q.numel() for q in build().parameters()), len(list(build().parameters()))
        f64 = accounting.expected_states_one_dtype(psi, tensors, 8) | {"activations": activations(8)}
        f16 = accounting.expected_states_mixed(psi, tensors) | {"activations": activations(2)}
        text = {
            "weights": "e Psi",
            "gradients": "e Psi",
            "moments": "2 e_m Psi",
            "master copy": "4 Psi",
            "step counts": "4 x tensors",
            "activations": "e x C x ...",
        }
        rows = [(k, text[k], f64.get(k, 0), plain.items.get(k, 0), f16[k], mixed.items[k]) for k in f16]
        print0(
            holds_table(
                f"{name}: Psi = {psi:,}; peak {plain.peak / 1024:,.1f} (f64), {mixed.peak / 1024:,.1f} KiB (mixed)",
                rows,
            )
        )
        print0("e: a weight's bytes (8; bf16: 2); e_m: a moment's (8; float32 under bf16: 4)")
        verdict.check(
            f"{name}: every item measured = its formula (float64, bf16 + float32 master)",
            all(a == b and e == f for _, _, a, b, e, f in rows),
        )
        verdict.figure(
            f"holds {name}",
            {"psi": psi, "float64": plain.items, "mixed": mixed.items, "peak": [plain.peak, mixed.peak]},
        )
    print0(
        "Activations: the MLP saves its input, each tanh output, the output and the target; the block "
        "18 x C seq d, the softmax C h seq^2 and the LayerNorms' statistics (accounting.py; on a GPU those "
        "are float32 under bf16). They shrink with C = N / P; the model states do not.",
        highlight=False,
    )


def show_zero(rt: Runtime, cfg: ShardingConfig, verdict: Verdict, ref) -> dict:
    print0(f"\n[bold]2. ZeRO-1, -2, -3 by hand: {cfg.steps} AdamW steps against one process[/]")
    runs = {"DDP": run_strategy(rt, cfg, Replicated)}
    runs |= {stage: run_strategy(rt, cfg, by_hand) for stage, by_hand in BY_HAND.items()}
    agree = {name: ("one process", against(ref, run)) for name, run in runs.items()}
    print0(agreement_table("Parameters, step 1's gradients, AdamW states: max |a-r|/max |r|", agree))
    verdict.check(
        "DDP and ZeRO-1/2/3 = one process: parameters, gradients, AdamW states, losses",
        all(all_ok(parts.values()) for _, parts in agree.values()),
    )
    units = units_of(build_model(cfg), rt.rank, rt.world_size)
    sizes = accounting.Sizes.of(units, rt.world_size, 8)
    mem, sent = [], []
    for stage in accounting.STAGES:
        run, formula = runs[stage], accounting.held(stage, sizes)
        mem.append((stage, sum(formula.values()), sum(run.held.values()), run.live_bytes, run.peak_bytes))
        verdict.check(f"{stage}: held per rank = formula, item by item", run.held == formula)
        verdict.check(
            f"{stage}: PeakMemory's live bytes = held - step counts",
            run.live_bytes == sum(run.held.values()) - run.held["step counts"],
        )
        expect = accounting.expected_bytes(stage, sizes, units[0].shard_numel)
        sent.append(
            (
                stage,
                "3(P-1)e Psi_P - g_0" if stage == "ZeRO-3" else "2(P-1) e Psi_P",
                expect,
                run.sent,
                run.sent / max(1, runs["DDP"].sent),
            )
        )
        verdict.check(f"{stage}: bytes sent per step = formula", run.sent == expect)
    print0(memory_table(f"Per rank, KiB: Psi = {sizes.psi:,}, Psi_P = {sizes.shard:,}", mem))
    print0(bytes_table("Bytes each rank sends per step (ring)", sent))
    print0(
        "g_0 = (P-1) e ceil(Psi_0 / P): ZeRO-3's backward gathers every layer again but the first, "
        "whose input needs no gradient, so backward never reads its weights.",
        highlight=False,
    )
    verdict.figure("memory", {row[0]: row[1:] for row in mem})
    verdict.figure("sent", {row[0]: row[2:4] for row in sent})
    return runs


def show_mixed(rt: Runtime, cfg: ShardingConfig, verdict: Verdict) -> None:
    """DDP and the stages again, unchanged, on bf16 weights with a float32 master
    (`distlab.data_split.sharding.mixed`)."""
    mixed = cfg.mixed()
    print0("\n[bold]2b. The same stages, mixed: bf16 weights, float32 master and moments[/]")
    sizes = accounting.Sizes.of(units_of(build_model(mixed), rt.rank, rt.world_size), rt.world_size, 2, 4)
    ref, agree, mem = reference(mixed), {}, []
    for stage, make in {"DDP": Replicated, **BY_HAND}.items():
        run, formula = run_strategy(rt, mixed, make), accounting.held(stage, sizes)
        agree[stage] = ("one process", against(ref, run, RTOL_MIXED, ATOL_MIXED))
        mem.append((stage, sum(formula.values()), sum(run.held.values()), run.live_bytes, run.peak_bytes))
        verdict.check(f"{stage} mixed: held per rank = formula, item by item", run.held == formula)
    print0(agreement_table("Against one process under the same recipe: max |a-r|/max |r|", agree))
    verdict.check(
        f"DDP and ZeRO-1/2/3 mixed = one process mixed (rtol {RTOL_MIXED}, atol {ATOL_MIXED})",
        all(all_ok(parts.values()) for _, parts in agree.values()),
    )
    print0(memory_table("Mixed, per rank, KiB", mem))
    print0(
        "bf16 sums in another order than one process's: a few bf16 roundings (2^-8) apart. Held: DDP "
        "2+2+4+8 = 16 Psi; ZeRO-1 4 Psi + 16 Psi_P; ZeRO-2 2 Psi + 16 Psi_P; ZeRO-3 16 Psi_P.",
        highlight=False,
    )
    verdict.figure("mixed_memory", {row[0]: row[1:] for row in mem})


def show_fsdp2(rt: Runtime, cfg: ShardingConfig, verdict: Verdict, ref, zero3_run) -> None:
    print0("\n[bold]3. FSDP2: fully_shard per layer = ZeRO-3 by hand[/]")
    rows, mem, gathers = {}, [], {}
    for reshard in (True, False):
        # LaunchCount sees every op dispatched, FSDP2's c10d all-gathers among them (none at P = 1).
        with LaunchCount() as ops:
            run = run_strategy(rt, cfg, functools.partial(Fsdp2, reshard_after_forward=reshard))
        if rt.world_size > 1:
            gathers[reshard] = ops.by_name["_allgather_base_"] // cfg.steps
        name = f"FSDP2 reshard={reshard}"
        rows[name] = ("ZeRO-3", against(zero3_run, run))
        rows[f"{name} "] = ("one process", against(ref, run))
        formula = fsdp_held(build_model(cfg), rt.world_size, rt.rank, 8)
        verdict.check(f"{name}: held per rank = formula (padded rows)", run.held == formula)
        mem.append((name, sum(formula.values()), sum(run.held.values()), run.live_bytes, -1))
    print0(agreement_table("fully_shard per layer, then the root; AdamW on DTensors", rows))
    verdict.check(
        "FSDP2 = ZeRO-3 by hand = one process: parameters, gradients, AdamW states",
        all(all_ok(parts.values()) for _, parts in rows.values()),
    )
    print0(memory_table("FSDP2 per rank, KiB", mem))
    print0(
        "FSDP2 frees a gathered layer by resizing its storage to 0 bytes, which PeakMemory does not see: "
        "its live bytes overstate, and no peak is shown; held counts the live storages.\n",
        highlight=False,
    )
    verdict.figure("fsdp2_memory", {row[0]: row[1:3] for row in mem})
    show_reshard(gathers, build_model(cfg), verdict)  # distlab/data_split/sharding/fsdp.py
    print0(
        rows_table(
            "FSDP2's options and the stages by hand",
            ("FSDP2", "by hand"),
            [
                ("fully_shard(layer)", "ZeRO-3: gather, free, gather again"),
                ("reshard_after_forward=False", "ZeRO-3, gathered layer kept to backward"),
                ("reshard_after_forward=k", "after forward, reshard over k ranks"),
                ("MixedPrecisionPolicy(bf16, f32)", "f32 shards = master; bf16 gathered"),
                ("set_requires_gradient_sync(False)", "no reduce-scatter (as no_sync)"),
            ],
        )
    )


def show_checkpoint(rt: Runtime, cfg: ShardingConfig, args, verdict: Verdict) -> None:
    p2 = max(1, rt.world_size // 2)
    print0(
        f"\n[bold]4. A distributed checkpoint: saved at P = {rt.world_size} after {cfg.steps} steps, "
        f"resumed at P = {rt.world_size} and at P = {p2} for {cfg.steps} more[/]"
    )
    # The lesson's own directory (no --checkpoint-dir) is removed however the run ends (`scratch_dir`).
    own = rt.is_first and not args.checkpoint_dir
    with scratch_dir(SCRATCH) if own else nullcontext() as scratch:
        path = [args.checkpoint_dir or (str(scratch / "checkpoint") if scratch else None)]
        dist.broadcast_object_list(path, src=0)  # one directory for every rank (one machine)
        run = save_and_resume(rt, cfg, path[0], cfg.steps, cfg.steps)
        dist.barrier()  # every rank has read it before rank 0 removes it
    ref = reference(cfg, 2 * cfg.steps).params
    same = all(torch.equal(run.uninterrupted[k], run.same_p[k]) for k in ref)
    straight = compare(ref, run.uninterrupted)
    other = compare(run.uninterrupted, run.other_p, 0.0, 1e-12) if run.other_p is not None else []
    worst = max((row.max_abs for row in other), default=0.0)
    print0(
        rows_table(
            "Every parameter after the last step, against the run that never stopped",
            ("run", "max |a - uninterrupted|", "claim"),
            [
                ("uninterrupted vs one process", f"{max(r.max_abs for r in straight):.1e}", "1e-10"),
                (f"resumed at P = {rt.world_size}", "0 (bit-identical)" if same else "differs", "bit-identical"),
                (f"resumed at P = {p2}", f"{worst:.1e}" if run.other_p is not None else "(not here)", "1e-12"),
            ],
        )
    )
    verdict.check("uninterrupted FSDP2 run = one process", all(r.ok for r in straight))
    verdict.check(f"resumed at P = {rt.world_size}: bit-identical to the uninterrupted run", same)
    verdict.check(f"resumed at P = {p2} (resharded): equal to 1e-12", all(r.ok for r in other))
    verdict.figure("resume", {"same_p_bit_identical": same, "other_p": p2, "other_p_max_abs": worst})


def parse_args():
    parser = lesson_parser(__doc__)
    add_global_batch(parser, 24)
    add_optimizer_args(parser, steps=3, lr=0.01, optimizer="AdamW")  # 3 steps, and 3 more after the checkpoint
    parser.add_argument("--weight-decay", type=positive_float, default=0.1, help="AdamW weight decay")
    parser.add_argument(
        "--checkpoint-dir",
        metavar="DIR",
        type=checkpoint_dir,
        help="where part 4 saves (kept); default a temporary directory, removed at the end",
    )
    return parser.parse_args()


def main() -> int:
    args = check_flags_against_world(parse_args(), divides_global_batch)  # before any process group
    cfg = ShardingConfig(
        global_batch=args.global_batch, steps=args.steps, lr=args.lr, weight_decay=args.weight_decay, seed=args.seed
    )
    with distributed(args.device, deterministic=True) as rt:  # the same-P resume is bit-identical, on GPUs too
        verdict = Verdict(rt)
        print0(
            f"[bold]Lesson 07: what a step holds; ZeRO-1/2/3, FSDP2, checkpoints[/] - P = {rt.world_size}, "
            f"N = {cfg.global_batch} (C = {cfg.global_batch // rt.world_size}), backend {rt.backend}, float64"
        )
        show_holds(rt, cfg, verdict)
        ref = reference(cfg)
        runs = show_zero(rt, cfg, verdict, ref)
        show_mixed(rt, cfg, verdict)
        show_fsdp2(rt, cfg, verdict, ref, runs["ZeRO-3"])
        show_checkpoint(rt, cfg, args, verdict)
        return verdict.finish(args.json)


if __name__ == "__main__":
    run_main(main)
