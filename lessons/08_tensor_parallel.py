"""Lesson 08: tensor and sequence parallelism, the layer itself split across ranks; torch's
`parallelize_module`; and two dimensions at once, data parallel x tensor parallel on a DeviceMesh.

    torchrun --nproc-per-node 2 lessons/08_tensor_parallel.py    # P = 1..4 (P must divide h, d_ff, seq)

The pipelines (01-05) cut the model between layers, data parallelism (06) the batch; here every
layer is cut. A Linear y = x A^T + b split by A's rows (column parallel) leaves rank r its d_out/P
outputs, Y_r = X A_r^T + b_r, from the whole X; split by A's columns (row parallel) it leaves a partial
sum, Y = sum_r X_r A_r^T + b. Column then row needs nothing in between, so the MLP of a transformer
(fc1 column, GELU, fc2 row; d_ff/P hidden units per rank) and its attention (q, k, v column, h/P whole
heads per rank, attention head by head, the output projection row) each communicate twice per step:

    f (before the column layers):  forward identity,     backward all-reduce of dL/dX
    g (after the row layer):       forward all-reduce,   backward identity

the two conjugate operators, written out below as autograd Functions (`Copy`, `Reduce`); the
library's `distlab/tensor_parallel/operators.py` holds the same and is proven equal to them. Bytes per
rank and step, e bytes an element: 2(P-1)/P N seq d e each way (N x seq x d: the activation), per MLP
and per attention (ring accounting of lesson 06). Heads h and width d_ff must divide by P.

Sequence parallelism. Between those regions the block runs LayerNorms, dropout and residual adds,
the same work on the same whole tensors on every rank. Cut them along the sequence instead, and
split each all-reduce into its halves: f-bar = all-gather forward / reduce-scatter backward, g-bar =
reduce-scatter forward / all-gather backward (`operators.GatherFromSP`, `ScatterToSP`). (Korthikanti
et al., "Reducing Activation Recomputation in Large Transformer Models", call these g and g-bar: their g
is our f-bar, the operator entering a tensor-parallel region, as our f is. Here the bar marks the sequence
parallel version of f and g, so f-bar enters a region and g-bar leaves it.) The bytes are
the same ((P-1)/P + (P-1)/P = 2(P-1)/P of N seq d e); the region's activations shrink by P; the
parameters used on sequence parts (LayerNorms, row biases: 6 d values) get partial gradients, all-
reduced once after backward. Dropout is exact because the masks of the whole batch are drawn from
(seed, step), each rank applying its part, the reference all of them (`model.dropout_masks`).

torch's own: the same block under `parallelize_module` with `ColwiseParallel`, `RowwiseParallel`,
`SequenceParallel` on a `DeviceMesh` over gloo; its parameters become DTensors with placements, and
DTensor derives the collectives from them. It computes what ours does; it communicates differently:
each ColwiseParallel layer carries its own f, so q, k and v all-reduce their input gradients three
times where our one f does it once, and under SequenceParallel the LayerNorms' gradients stay
Partial until the optimizer step all-reduces them, one tensor each (`distlab/tensor_parallel/torch_tp.py`).

Two dimensions: on a dp x tp mesh (`init_device_mesh(..., mesh_dim_names=("dp", "tp"))`, 2 x 2 at P = 4)
each row splits the block, each column holds the same shard on N/dp rows and sums its gradients
(`distlab/tensor_parallel/mesh2d.py`).

Every claim is checked against an independent reference: the unsplit layer (a deep copy) trained in
one process on the whole batch with plain autograd, float64: outputs, every gradient (the input's
too), parameters and losses after --steps SGD steps; bytes against the formulas
(`distlab/tensor_parallel/cost.py`); activation memory measured (`PeakMemory`) against its formula.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist

from distlab.cli import add_optimizer_args, check_flags_against_world, fraction, lesson_parser, positive_int, require
from distlab.comm.ledger import Ledger
from distlab.compare import all_ok, compare
from distlab.console import compact_table, print0
from distlab.runtime import Runtime, distributed, run_main
from distlab.tensor_parallel import cost, mesh2d, operators, torch_tp
from distlab.tensor_parallel.blocks import check_split
from distlab.tensor_parallel.layers import reference_shards
from distlab.tensor_parallel.model import BlockConfig
from distlab.tensor_parallel.operator_checks import check_operator
from distlab.tensor_parallel.report import COLLECTIVE, bytes_table, equality_table, mark
from distlab.tensor_parallel.runs import activation_bytes_measured, reference, same_runs, split_run
from distlab.verdict import Verdict

# ---- the mechanism: the two conjugate operators, by hand ----------------------------------------


class Copy(torch.autograd.Function):
    """f: every rank already holds the whole X; backward, each rank's dL/dX covers only its own
    outputs, and the whole gradient is their sum: all-reduce."""

    @staticmethod
    def forward(ctx, x, group, ledger):
        ctx.group, ctx.ledger = group, ledger
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)  # sum_r dL/dX through rank r's columns
        ctx.ledger.record("backward", "all_reduce", grad, ctx.group)  # what a ring sends for it
        return grad, None, None


class Reduce(torch.autograd.Function):
    """g: each rank holds a partial sum X_r A_r^T; forward adds them up (all-reduce); backward the
    gradient of a sum is the same for every addend: identity."""

    @staticmethod
    def forward(ctx, x, group, ledger):
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        ledger.record("forward", "all_reduce", x, group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


def by_hand(group=None) -> operators.Comm:
    """A block's (enter, exit) pair made of this lesson's f and g."""
    return operators.Comm(Copy, Reduce, group, Ledger())


# ---- the chapter, part by part ------------------------------------------------------------------


def show_operators(rt: Runtime, verdict: Verdict) -> None:
    print0("\n[bold]1. The conjugate operators, against one process holding every rank's tensors[/]")
    ops = {
        "f (lesson)": ("f", Copy),
        "g (lesson)": ("g", Reduce),
        "f (library)": ("f", operators.CopyToTP),
        "g (library)": ("g", operators.ReduceFromTP),
        "f-bar": ("f-bar", operators.GatherFromSP),
        "g-bar": ("g-bar", operators.ScatterToSP),
    }
    results = {name: check_operator(rt, math, fn) for name, (math, fn) in ops.items()}
    out = compact_table("Each operator forward and backward", ("operator", "forward", "backward", "max err", "exact"))
    for name, res in results.items():
        err = max(c.max_abs for c in res.against.values())
        out.add_row(name, *_semantics(res.name), f"{err:.0e}", mark(res.ok))
    print0(out)
    same = all(
        torch.equal(results[f"{k} (lesson)"].forward, results[f"{k} (library)"].forward)
        and torch.equal(results[f"{k} (lesson)"].backward, results[f"{k} (library)"].backward)
        for k in "fg"
    )
    verdict.check("f, g, f-bar, g-bar forward, backward = one process's", all(r.ok for r in results.values()))
    verdict.check("the library's f and g = the lesson's, bit for bit", same)


def _semantics(name: str) -> tuple[str, str]:
    return {
        "f": ("identity", "all-reduce"),
        "g": ("all-reduce", "identity"),
        "f-bar": ("all-gather", "reduce-scatter"),
        "g-bar": ("reduce-scatter", "all-gather"),
    }[name]


def show_tensor_parallel(rt: Runtime, cfg: BlockConfig, args, verdict: Verdict) -> None:
    print0(f"\n[bold]2. Tensor parallelism by hand: the MLP and attention, {args.steps} SGD steps[/]")
    p = rt.world_size
    outcomes = {part: split_run(rt, cfg, part, by_hand(), args.steps, args.lr) for part in ("mlp", "attention")}
    print0(equality_table(f"Split over P = {p} (the lesson's f and g) against the unsplit layer", outcomes))
    rows = [
        (part, _sent(o.ledger), _nonzero(cost.expected_traffic(cfg, part, p, False, args.steps)))
        for part, o in outcomes.items()
    ]
    print0(
        bytes_table(
            f"Bytes rank {rt.rank} sent in {args.steps} steps; formula 2(P-1)/P N seq d e "
            f"each way a step, N seq d = {cfg.batch * cfg.seq * cfg.dim}, e = 8",
            rows,
        )
    )
    verdict.check(
        f"MLP, attention by heads = unsplit (P = {p}, {args.steps} steps)", all(o.ok for o in outcomes.values())
    )
    verdict.check("their bytes per rank = 2(P-1)/P N seq d e each way", all(c == f for _, c, f in rows))


def _sent(ledger: Ledger) -> dict:
    return _nonzero(ledger.sent_by)


def _nonzero(bytes_by_key: dict) -> dict:  # at P = 1 nothing is sent: no rows
    return {key: value for key, value in bytes_by_key.items() if value}


SPLITS = {"TP": operators.tensor_parallel, "TP + SP": operators.sequence_parallel}


def show_sequence_parallel(rt: Runtime, cfg: BlockConfig, args, verdict: Verdict) -> None:
    print0(f"\n[bold]3. Sequence parallelism (SP) beside tensor parallelism (TP): the block, dropout {cfg.dropout}[/]")
    p = rt.world_size
    outcomes = {name: split_run(rt, cfg, "block", make(), args.steps, args.lr) for name, make in SPLITS.items()}
    print0(equality_table(f"The block on P = {p} against the unsplit block, the same masks", outcomes))
    rows = [
        (name, _sent(o.ledger), _nonzero(cost.expected_traffic(cfg, "block", p, name != "TP", args.steps)))
        for name, o in outcomes.items()
    ]
    print0(bytes_table(f"Bytes rank {rt.rank} sent in {args.steps} steps, and the formulas", rows))
    tp_bytes, sp_bytes = (o.ledger.sent_in("forward") + o.ledger.sent_in("backward") for o in outcomes.values())
    verdict.check(f"the block, TP and TP + SP = unsplit (P = {p}, dropout on)", all(o.ok for o in outcomes.values()))
    verdict.check(
        "block bytes = formulas; SP's activations send what TP's do",
        all(c == f for _, c, f in rows) and tp_bytes == sp_bytes,
    )
    show_memory(rt, cfg, verdict)


def show_memory(rt: Runtime, cfg: BlockConfig, verdict: Verdict) -> None:
    p, (region, gathered, split) = rt.world_size, cost.activation_terms(cfg)
    out = compact_table(
        f"What one block's forward keeps for backward on rank {rt.rank}, bytes",
        ("split", "measured", "formula", "=", "peak"),
        caption=f"formula: region + gathered + inside/P (TP), (region + inside)/P + gathered "
        f"(TP + SP), elements x 8: region = N seq (2d+4) = {region}, gathered = 2 N seq d = "
        f"{gathered}, inside = N seq (4d + 2d_ff) + N h seq = {split}. "
        "peak: PeakMemory's, temporaries and collective buffers included",
    )
    measured = {}
    for name, make in SPLITS.items():
        (saved, peak), formula = activation_bytes_measured(rt, cfg, make()), cost.activation_bytes(cfg, p, name != "TP")
        measured[name] = (saved, formula)
        out.add_row(name, f"{saved:,}", f"{int(formula):,}", mark(saved == formula), f"{peak:,}")
    print0(out)
    verdict.check("activations per rank = the formulas, TP and TP + SP", all(m == f for m, f in measured.values()))
    verdict.figure("activation_bytes", {n: m for n, (m, _) in measured.items()})


def show_torch(rt: Runtime, cfg: BlockConfig, args, verdict: Verdict) -> None:
    print0("\n[bold]4. torch's parallelize_module on a DeviceMesh (dropout off), against ours[/]")
    cfg = replace(cfg, dropout=0.0)
    out = compact_table(
        "Collectives launched per step: ours, and torch's (CommDebugMode)",
        ("split", "phase", "collective", "ours", "torch"),
        caption="torch: q, k and v each all-reduce their input's gradient (3 where our one f "
        "before all three needs 1); with SequenceParallel the LayerNorms' gradients stay "
        "Partial and the optimizer step all-reduces them one tensor each (ours: one "
        "message of 6 d, the row biases too; torch adds a row bias before the reduce-scatter)",
    )
    same = []
    for name, make in SPLITS.items():
        comm = make()
        ours = split_run(rt, cfg, "block", comm, args.steps, args.lr)
        theirs, counts, placements = torch_tp.torch_run(rt, cfg, name != "TP", args.steps, args.lr)
        same.append(ours.ok and same_runs(ours.run, theirs))
        for phase, key in (("forward", "forward"), ("backward", "backward"), ("optimizer step", "gradients")):
            mine = {k[1]: n // args.steps for k, n in comm.ledger.calls.items() if k[0] == key}
            shown = phase
            for kind in sorted(set(mine) | set(counts[phase])):
                out.add_row(name, shown, COLLECTIVE[kind], str(mine.get(kind, 0)), str(counts[phase].get(kind, 0)))
                name = shown = ""
    print0(out)
    print0(
        "torch's placements: " + "; ".join(f"{k} {v}" for k, v in placements.items() if k.endswith("weight")),
        highlight=False,
    )
    verdict.check("parallelize_module TP and TP + SP = ours (output, grads, params)", all(same))


def show_two_d(rt: Runtime, cfg: BlockConfig, args, verdict: Verdict) -> None:
    dp, tp = mesh2d.mesh_shape(rt.world_size)
    print0(f"\n[bold]5. Two dimensions: a {dp} x {tp} mesh (dp x tp), one SGD step on N = {cfg.batch}[/]")
    run, model, where = mesh2d.two_d_step(rt, cfg, args.lr)
    ref = reference(cfg, "block", 1, args.lr)
    ref.first_grads.pop("input")
    grads = all_ok(compare(reference_shards(ref.first_grads, model, where["i_tp"], tp), run.first_grads))
    params = all_ok(compare(reference_shards(ref.params, model, where["i_tp"], tp), run.params))
    counted = _sent(model.attn.comm.ledger)
    shard = sum(q.numel() for q in model.parameters())
    formula = _nonzero(mesh2d.expected_2d_traffic(cfg, rt.world_size, shard))
    print0(f"rank {rt.rank}: tensor-parallel group {where['tp_ranks']}, data-parallel group {where['dp_ranks']}")
    print0(
        bytes_table(
            f"Bytes rank {rt.rank} sent in one 2-D step ({shard} parameters in its shard)",
            [(f"{dp} x {tp}", counted, formula)],
        )
    )
    verdict.check(f"one {dp} x {tp} (dp x tp) step = one process, whole batch", grads and params)
    verdict.check("2-D bytes = formulas (TP on N/dp rows, DP on the shard)", counted == formula)


def parse_args():
    parser = lesson_parser(__doc__)
    parser.add_argument("--global-batch", type=positive_int, default=12, help="sequences per step, N")
    parser.add_argument("--seq-len", type=positive_int, default=12, help="tokens per sequence, seq")
    parser.add_argument("--dim", type=positive_int, default=24, help="model width d (h must divide it)")
    add_optimizer_args(parser, steps=3, lr=0.5)
    parser.add_argument("--heads", type=positive_int, default=12, help="attention heads h (P must divide it)")
    parser.add_argument("--ffn-width", type=positive_int, default=48, help="MLP hidden width d_ff (P must divide it)")
    parser.add_argument("--dropout", type=fraction, default=0.1, help="dropout probability of the block")
    args = parser.parse_args()
    require(args.dim % args.heads == 0, "--dim", f"d = {args.dim} is not a multiple of h = {args.heads}")
    return args


def block_config(args) -> BlockConfig:
    return BlockConfig(args.global_batch, args.seq_len, args.dim, args.heads, args.ffn_width, args.dropout, args.seed)


def world_rules(args, world_size: int) -> None:
    """The splits P must make: heads, d_ff and seq over P, the batch over the mesh's dp groups."""
    check_split(args.heads, args.ffn_width, world_size, args.seq_len)
    mesh2d.check_mesh(block_config(args), world_size)


def main() -> int:
    args = check_flags_against_world(parse_args(), world_rules)  # before any process group, every rank alike
    cfg = block_config(args)
    with distributed(args.device) as rt:
        verdict = Verdict(rt)
        print0(
            f"[bold]Lesson 08: tensor and sequence parallelism[/] - P = {rt.world_size}, N = {cfg.batch}, "
            f"seq = {cfg.seq}, d = {cfg.dim}, h = {cfg.heads}, d_ff = {cfg.ffn}, backend {rt.backend}, float64"
        )
        show_operators(rt, verdict)
        show_tensor_parallel(rt, cfg, args, verdict)
        show_sequence_parallel(rt, cfg, args, verdict)
        show_torch(rt, cfg, args, verdict)
        show_two_d(rt, cfg, args, verdict)
        return verdict.finish(args.json)


if __name__ == "__main__":
    run_main(main)
