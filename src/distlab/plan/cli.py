"""python -m distlab.plan: which split of a model over a cluster fits, and which is fastest.

    python -m distlab.plan --model llama3-70b --gpu h100 --gpus 64 --nodes 8 --global-batch 512 --seq-len 8192
    python -m distlab.plan --layers 32 --dim 4096 --heads 32 --ffn-width 16384 --vocab 50304 --gpus 16 --nodes 2
    python -m distlab.plan --published        # the published runs beside their predictions
    python -m distlab.plan --devices          # the datasheet figures and their sources

It enumerates the configurations (distlab/plan/search.py), keeps those whose every rank fits the GPU's
memory by the cost model (distlab/cost), ranks them by predicted step time, and prints the fastest with
their memory, step time and MFU, then the assumptions the prediction rests on. A bad input is refused in
one line naming its flag.
"""

from __future__ import annotations

import json

from distlab.cost.hardware import DEVICES, GIB, cluster
from distlab.cost.shapes import Transformer
from distlab.cost.timing import Assumptions
from distlab.plan import report
from distlab.plan.presets import MODELS
from distlab.plan.search import search
from distlab.processes.flags import FlagParser, add_global_batch, fraction, positive_int
from distlab.proof.console import console

MAX_PER_NODE = 8  # the HGX and DGX systems these datasheets describe


def parse_args(argv=None):
    # no lesson's memory limits: the planner builds no tensor (its own limits, with their reasons, are `limits=`)
    parser = FlagParser(prog="python -m distlab.plan", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=MODELS, default="llama3-8b", help="a published model")
    for flag, what in (("--layers", "blocks"), ("--dim", "width d"), ("--heads", "heads h"), ("--ffn-width", "d_ff")):
        parser.add_argument(flag, type=positive_int, help=f"a model of your own: {what} (with the other three)")
    parser.add_argument("--vocab", type=positive_int, help="your model's vocabulary (default: no embedding, no head)")
    parser.add_argument("--gpu", choices=DEVICES, default="h100", help="GPU type (datasheet figures: --devices)")
    parser.add_argument("--gpus", type=positive_int, default=8, help="GPUs in all, G")
    parser.add_argument("--nodes", type=positive_int, default=1, help="nodes (G / nodes GPUs each, at most 8)")
    add_global_batch(parser, 64)
    parser.add_argument("--seq-len", type=positive_int, default=8192, help="tokens per sequence, seq")
    parser.add_argument("--precision", choices=("bf16", "float32"), default="bf16", help="what the step computes in")
    parser.add_argument("--top", type=positive_int, default=10, help="configurations shown")
    parser.add_argument("--matmul-efficiency", type=fraction, default=0.7, help="share of the dense peak reached")
    parser.add_argument("--link-efficiency", type=fraction, default=0.8, help="share of a link's bandwidth reached")
    parser.add_argument("--plot", metavar="PATH", help="also draw MFU against memory per GPU into this PNG")
    parser.add_argument("--json", metavar="PATH", help="also write every fitting configuration here")
    parser.add_argument("--published", action="store_true", help="the published runs beside their predictions")
    parser.add_argument("--devices", action="store_true", help="the datasheet figures and their sources")
    return parser.parse_args(argv)


def model_of(args) -> tuple[str, Transformer]:
    own = {"--layers": args.layers, "--dim": args.dim, "--heads": args.heads, "--ffn-width": args.ffn_width}
    if not any(own.values()):
        if args.vocab:
            raise ValueError("--vocab: a vocabulary belongs to a model of your own (--layers, --dim, --heads, ...)")
        return args.model, MODELS[args.model]
    missing = [flag for flag, value in own.items() if not value]
    if missing:
        raise ValueError(f"{missing[0]}: a model of your own needs --layers, --dim, --heads and --ffn-width")
    if args.dim % args.heads:
        raise ValueError(f"--heads: h = {args.heads} does not divide d = {args.dim}")
    model = Transformer(args.layers, args.dim, args.heads, args.ffn_width, args.vocab or 0)
    return f"{args.layers} blocks, d = {args.dim}, h = {args.heads}, d_ff = {args.ffn_width}", model


def check_cluster(args) -> int:
    """GPUs per node, or the one-line refusal."""
    if args.gpus % args.nodes:
        raise ValueError(f"--nodes: {args.gpus} GPUs do not spread evenly over {args.nodes} nodes")
    per_node = args.gpus // args.nodes
    if per_node > MAX_PER_NODE:
        raise ValueError(f"--nodes: {per_node} GPUs per node; a node of these holds at most {MAX_PER_NODE}")
    return per_node


def main(argv=None) -> int:
    args = parse_args(argv)
    assumptions = Assumptions(args.matmul_efficiency or 0.7, args.link_efficiency or 0.8)
    if args.devices:
        console.print(report.devices_table())
        return 0
    if args.published:
        rows = report.published_rows(assumptions)
        console.print(report.published_table(rows))
        for line in [f"{r['name']}: {r['split']}; {r['assumed']}" for r in rows] + assumptions.lines():
            console.print("  " + line, highlight=False)
        return 0
    name, model = model_of(args)
    where = cluster(args.gpu, check_cluster(args))
    found = search(model, args.global_batch, args.seq_len, args.gpus, where, args.precision, assumptions)
    tokens = args.global_batch * args.seq_len
    console.print(
        f"{name}: {model.parameters / 1e9:.2f} B parameters; {tokens:,} tokens per step on {args.gpus} x "
        f"{where.device.name} ({args.nodes} node{'s' * (args.nodes > 1)}), {args.precision}",
        highlight=False,
    )
    if not found:
        console.print("nothing fits: no split of these sizes holds every rank in memory", highlight=False)
        return 1
    console.print(report.plan_table(found, args.top, where.device.memory))
    for line in assumptions.lines() + [f"{where.device.name}: {where.device.source}"]:
        console.print("  " + line, highlight=False)
    if args.plot:
        report.plot(found, args.plot, f"{name} on {args.gpus} x {where.device.name}")
    if args.json:
        rows = [
            {
                "split": c.parallel.label(),
                "micro_batches": c.cost.batch.micro_batches,
                "memory_gib": c.memory / GIB,
                "step_s": c.time.step,
                "mfu": c.time.mfu,
            }
            for c in found
        ]
        with open(args.json, "w") as out:
            json.dump(rows, out, indent=1)
    return 0
