"""python -m distlab.plan: which split of a model over a cluster fits, and which is fastest; or what one
given split costs.

    python -m distlab.plan --model llama3-70b --gpu h100 --gpus 64 --nodes 8 --global-batch 512 --seq-len 8192
    python -m distlab.plan --layers 12 --dim 768 --heads 12 --ffn-width 3072 --vocab 50304 --tied-embeddings \\
        --seq-len 1024 --global-batch 480 --gpu a100-40gb --gpus 8 --layout dp=8
    python -m distlab.plan --model deepseek-v3 --gpu h800 --gpus 2048 --nodes 256 --global-batch 15360 \\
        --seq-len 4096 --layout dp=128,pp=16,ep=64 --schedule dualpipe --precision fp8 --grad-dtype float32 \\
        --measures deepseek-v3
    python -m distlab.plan --published        # the published runs beside their predictions
    python -m distlab.plan --devices          # the datasheet figures and their sources

Without --layout it enumerates the configurations (distlab/plan/search.py), keeps those whose every rank
fits the GPU's memory less the reserve by the cost model (distlab/cost), ranks them by predicted step time,
and prints the fastest with their memory, step time, MFU and TFLOP/s a GPU; a strategy flag given (--zero,
--recompute, --micro-batch, --schedule, --stages-per-rank, --grad-dtype, --sp, --measures) narrows the search
to it. With --layout it prices that one layout with the strategy the flags give (their defaults where not
given), its memory item by item. Then the assumptions the prediction rests on, each with the flag that
overrides it. A bad input is refused in one line naming its flag.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

from distlab.composed.dims import ParallelDims
from distlab.cost.inputs import DEEPSEEK_V3_MEASURES, MEASURES, Batch, Parallel
from distlab.cost.rules import check
from distlab.cost.schedule import CLOSED_FORMS  # two stages a rank, a V
from distlab.cost.stacks import DEFAULT_STACK, STACKS
from distlab.cost.timing import Assumptions
from distlab.plan import report
from distlab.plan.flags import LIMITS
from distlab.plan.presets import MODELS
from distlab.plan.search import RECOMPUTE, Choices, least_memory, price, search
from distlab.processes.console import console
from distlab.processes.flags import (
    FlagParser,
    add_global_batch,
    nonnegative_float,
    nonnegative_int,
    png_file,
    positive_float,
    positive_int,
    share,
    writable_file,
)
from distlab.proof.hardware import DEFAULT_RESERVE_GIB, DEVICES, GIB, cluster
from distlab.proof.sizes import Transformer

MAX_PER_NODE = 8  # the HGX and DGX systems these datasheets describe
DEFAULT_MODEL = "llama3-8b"
SCHEDULES = {
    "1f1b": "1f1b",
    "interleaved": "interleaved-1f1b",
    "zero-bubble": "zb-h1",
    "dualpipev": "dualpipev",
    "dualpipe": "dualpipe",
}
OVERLAP = ("dp", "cp", "pp", "ep", "tp")


def parse_args(argv=None):
    # the planner builds no tensor: its own limits (typo guards, with their reasons), none of the lessons'; its
    # help texts say their defaults in words ("no embedding", "--ffn-width"), so argparse adds none
    parser = FlagParser(
        prog="python -m distlab.plan",
        description=__doc__.split("\n\n")[0],
        limits=LIMITS,
        formatter_class=argparse.HelpFormatter,
    )
    model = parser.add_argument_group("the model: a preset, or your own")
    model.add_argument("--model", choices=MODELS, help=f"a published model (default {DEFAULT_MODEL})")
    for flag, what in (("--layers", "blocks"), ("--dim", "width d"), ("--heads", "heads h"), ("--ffn-width", "d_ff")):
        model.add_argument(flag, type=positive_int, help=f"a model of your own: {what} (with the other three)")
    model.add_argument("--vocab", type=positive_int, help="vocabulary (default: no embedding, no head)")
    model.add_argument("--kv-heads", type=positive_int, help="key/value heads (grouped-query attention)")
    model.add_argument("--head-dim", type=positive_int, help="d_h, if not d / h")
    model.add_argument(
        "--ffn", choices=("gelu", "swiglu"), default="gelu", help="gelu: GPT's (biases, LayerNorm); swiglu: Llama's"
    )
    model.add_argument("--tied-embeddings", action="store_true", help="the head is the embedding's matrix")
    model.add_argument("--experts", type=nonnegative_int, default=0, help="routed experts (a mixture of experts)")
    model.add_argument("--top-k", type=positive_int, default=1, help="experts per token")
    model.add_argument("--expert-ffn-width", type=positive_int, help="an expert's width (default: --ffn-width)")
    model.add_argument("--shared-experts", type=nonnegative_int, default=0, help="always-on experts of the same width")
    model.add_argument("--dense-layers", type=nonnegative_int, default=0, help="the first blocks, dense (DeepSeek: 3)")
    model.add_argument("--q-rank", type=nonnegative_int, default=0, help="multi-head latent attention: query latent")
    model.add_argument(
        "--kv-rank", type=nonnegative_int, default=0, help="multi-head latent attention: key/value latent"
    )
    model.add_argument("--rope-dim", type=nonnegative_int, default=0, help="multi-head latent attention: rotary part")
    run = parser.add_argument_group("the run")
    run.add_argument("--gpu", choices=DEVICES, default="h100", help="GPU type (datasheet figures: --devices)")
    run.add_argument("--gpus", type=positive_int, default=8, help="GPUs in all, G")
    run.add_argument("--nodes", type=positive_int, default=1, help="nodes (G / nodes GPUs each, at most 8)")
    add_global_batch(run, 64)
    run.add_argument("--seq-len", type=positive_int, default=8192, help="tokens per sequence, seq")
    run.add_argument("--precision", choices=("bf16", "fp8", "float32"), default="bf16", help="what products run in")
    run.add_argument(
        "--reserve-gib", type=nonnegative_float, default=DEFAULT_RESERVE_GIB, help="kept off the tensors (GiB)"
    )
    run.add_argument(
        "--inter-node-gbps", type=positive_float, help="network Gb/s per GPU and direction (default: the GPU's NIC)"
    )
    split = parser.add_argument_group("the strategy: one layout (--layout) priced whole, or the search narrowed")
    split.add_argument("--layout", help="dp=..,tp=..,pp=..,cp=..,ep=.. (a missing one is 1)")
    split.add_argument(
        "--schedule",
        choices=SCHEDULES,
        help="the pipeline's schedule (--layout: default 1f1b); dualpipe holds two copies of the parameters",
    )
    split.add_argument("--stages-per-rank", type=positive_int, help="v, for interleaved (--layout: default 2)")
    split.add_argument("--micro-batch", type=positive_int, help="sequences per micro-batch, b (--layout: default 1)")
    split.add_argument(
        "--recompute",
        choices=RECOMPUTE,
        help="selective: Megatron-LM's (attention's core rerun); act-fn: the MLP's activation function rebuilt; "
        "full: every block (--layout: default none)",
    )
    split.add_argument("--zero", type=int, choices=range(4), help="ZeRO stage 0 (DDP) to 3 (default 1 with dp > 1)")
    split.add_argument("--grad-dtype", choices=("bf16", "float32"), help="gradients' dtype (--layout: default bf16)")
    split.add_argument("--sp", choices=("on", "off"), default="on", help="sequence parallelism beside tp")
    split.add_argument(
        "--measures",
        help=f"DeepSeek-V3's memory measures, comma-separated: {', '.join(MEASURES)}; or deepseek-v3 for all three",
    )
    time = parser.add_argument_group("the time model's assumptions (default: the --stack's profile)")
    time.add_argument(
        "--stack", choices=STACKS, default=DEFAULT_STACK, help="the software the run uses: its efficiency profile"
    )
    for flag, what in (
        ("--matmul-efficiency", "share of the dense peak a large product reaches"),
        ("--attention-efficiency", "share of the dense peak attention reaches"),
        ("--attention-share", "share of seq^2 products computed (causal: about half)"),
        ("--link-efficiency", "share of a link's bandwidth reached"),
    ):
        time.add_argument(flag, type=share, help=f"{what} (0 < x <= 1)")
    time.add_argument("--overlap", help=f"dimensions hidden behind compute: {OVERLAP}")
    out = parser.add_argument_group("output")
    out.add_argument("--top", type=positive_int, default=10, help="configurations shown")
    out.add_argument("--plot", metavar="PATH", type=png_file, help="also draw MFU against memory into this PNG")
    out.add_argument("--json", metavar="PATH", type=writable_file, help="also write the result here")
    out.add_argument("--published", action="store_true", help="the published runs beside their predictions")
    out.add_argument("--devices", action="store_true", help="the datasheet figures and their sources")
    return parser.parse_args(argv)


def model_of(args) -> tuple[str, Transformer]:
    own = {"--layers": args.layers, "--dim": args.dim, "--heads": args.heads, "--ffn-width": args.ffn_width}
    extra = ("vocab", "kv_heads", "head_dim", "tied_embeddings", "experts", "q_rank", "kv_rank", "expert_ffn_width")
    if not any(own.values()):
        named = next((f"--{name.replace('_', '-')}" for name in extra if getattr(args, name)), None)
        if named:
            raise ValueError(f"{named}: belongs to a model of your own (--layers, --dim, --heads, --ffn-width)")
        return args.model or DEFAULT_MODEL, MODELS[args.model or DEFAULT_MODEL]
    if args.model:
        given = next(flag for flag, value in own.items() if value)
        raise ValueError(f"--model: {args.model} is a preset, {given} a model of your own: give one, not both")
    missing = [flag for flag, value in own.items() if not value]
    if missing:
        raise ValueError(f"{missing[0]}: a model of your own needs --layers, --dim, --heads and --ffn-width")
    if args.dim % args.heads and not args.head_dim:
        raise ValueError(f"--heads: h = {args.heads} does not divide d = {args.dim} (or give --head-dim)")
    if args.kv_heads and args.heads % args.kv_heads:
        raise ValueError(f"--kv-heads: {args.kv_heads} key/value heads do not divide h = {args.heads}")
    moe_flags = {"--top-k": args.top_k > 1, "--expert-ffn-width": args.expert_ffn_width}
    moe_flags |= {"--shared-experts": args.shared_experts, "--dense-layers": args.dense_layers}
    stray = next((flag for flag, given in moe_flags.items() if given and not args.experts), None)
    if stray:
        raise ValueError(f"{stray}: belongs to a mixture of experts (--experts)")
    if args.experts and args.top_k > args.experts:
        raise ValueError(f"--top-k: {args.top_k} experts per token, but only {args.experts} experts")
    if args.dense_layers > args.layers:
        raise ValueError(f"--dense-layers: {args.dense_layers}, but only {args.layers} layers")
    if (args.q_rank or args.rope_dim) and not args.kv_rank:
        raise ValueError("--kv-rank: multi-head latent attention (--q-rank, --rope-dim) needs its key/value latent")
    swiglu = args.ffn == "swiglu"
    model = Transformer(
        args.layers,
        args.dim,
        args.heads,
        args.ffn_width,
        args.vocab or 0,
        kv_heads=args.kv_heads or 0,
        gated=swiglu,
        bias=not swiglu,
        rms_norm=swiglu,
        tied=args.tied_embeddings,
        head_size=args.head_dim or 0,
        q_rank=args.q_rank,
        kv_rank=args.kv_rank,
        rope_dim=args.rope_dim,
        experts=args.experts,
        top_k=args.top_k if args.experts else 0,
        expert_ffn=(args.expert_ffn_width or args.ffn_width) if args.experts else 0,
        shared_experts=args.shared_experts if args.experts else 0,
        dense_layers=args.dense_layers if args.experts else 0,
    )
    what = f"{args.layers} blocks, d = {args.dim}, h = {args.heads}, d_ff = {args.ffn_width}, {args.ffn}"
    if args.experts:
        what += f", {args.experts} experts top-{args.top_k}"
    return what, model


def check_cluster(args) -> int:
    """GPUs per node, or the one-line refusal."""
    if args.gpus % args.nodes:
        raise ValueError(f"--nodes: {args.gpus} GPUs do not spread evenly over {args.nodes} nodes")
    per_node = args.gpus // args.nodes
    if per_node > MAX_PER_NODE:
        raise ValueError(f"--nodes: {per_node} GPUs per node; a node of these holds at most {MAX_PER_NODE}")
    return per_node


def overrides_of(args) -> dict:
    """The time model's assumptions the flags give, over the stack's profile (only those given)."""
    given = {
        name: getattr(args, name)
        for name in ("matmul_efficiency", "link_efficiency", "attention_efficiency", "attention_share")
        if getattr(args, name) is not None
    }
    if args.overlap is not None:
        overlap = tuple(d.strip() for d in args.overlap.split(",") if d.strip())
        bad = [d for d in overlap if d not in OVERLAP]
        if bad:
            raise ValueError(f"--overlap: {bad[0]!r} is not one of {', '.join(OVERLAP)}")
        given["overlap"] = overlap
    return given


def assumptions_of(args) -> Assumptions:
    return replace(STACKS[args.stack].assumptions, **overrides_of(args))


def choices_of(args) -> Choices:
    """The strategy flags the user gave, as the search's `Choices` (None where the search chooses)."""
    schedule = SCHEDULES[args.schedule] if args.schedule else None
    v = args.stages_per_rank
    if v is not None and v > 1 and args.schedule in ("1f1b", None):
        raise ValueError("--stages-per-rank: 1F1B runs one stage per rank; --schedule interleaved takes v > 1")
    if v == 1 and args.schedule == "interleaved":
        raise ValueError("--stages-per-rank: interleaving runs v > 1 stages per rank; --schedule 1f1b takes v = 1")
    if v is not None and v > 1 and args.schedule == "zero-bubble":
        schedule = "interleaved-zb"
    if v is not None and v != 2 and schedule in CLOSED_FORMS:
        raise ValueError(f"--stages-per-rank: {args.schedule} runs two stages per rank (a V), v = 2")
    return Choices(
        measures=measures_of(args.measures),
        precision=args.precision,
        zero=None if args.zero is None else "DDP" if args.zero == 0 else f"ZeRO-{args.zero}",
        recompute=args.recompute,
        micro_batch=args.micro_batch,
        schedule=schedule,
        stages_per_rank=v,
        grad_bytes={"float32": 4, "bf16": 2, None: 0}[args.grad_dtype],
        sp=args.sp == "on",
    )


def measures_of(text: str | None) -> tuple[str, ...]:
    """--measures as names of `MEASURES` ("deepseek-v3": all three), or the one-line refusal."""
    if text is None:
        return ()
    names = [m.strip() for m in text.split(",") if m.strip()]
    if names == ["deepseek-v3"]:
        return DEEPSEEK_V3_MEASURES
    bad = next((m for m in names if m not in MEASURES), None) if names else text
    if bad is not None:
        raise ValueError(f"--measures: {bad!r} is not one of {', '.join(MEASURES)} (or deepseek-v3 for all)")
    return tuple(dict.fromkeys(names))


def layout_of(args, model: Transformer, choices: Choices) -> tuple[Batch, Parallel]:
    """--layout and the strategy flags as the cost model's batch and split (one line naming a bad flag); a flag
    not given takes its default: 1F1B, one sequence a micro-batch, no recomputation, ZeRO-1 with dp > 1."""
    dims = ParallelDims.parse_layout(args.layout)
    if dims.size != args.gpus:
        raise ValueError(f"--layout: dp x pp x tp x cp = {dims.size} ranks, but --gpus {args.gpus}")
    b, rows = choices.micro_batch or 1, args.global_batch // dims.dp
    if args.global_batch % dims.dp or rows % b:
        raise ValueError(
            f"--micro-batch: N = {args.global_batch} does not cut into dp = {dims.dp} x micro-batches of {b}"
        )
    if choices.zero not in (None, "DDP") and dims.dp == 1:
        raise ValueError(f"--zero: {choices.zero} shards over the dp ranks; --layout gives dp = 1, none to shard over")
    schedule = choices.schedule or "1f1b"
    v = choices.stages_per_rank or (2 if schedule.startswith("interleaved") or schedule in CLOSED_FORMS else 1)
    strategy = dict(
        zero=choices.zero or ("ZeRO-1" if dims.dp > 1 else "DDP"),
        schedule=schedule,
        stages_per_rank=v,
        **choices.strategy(dims.tp),
        **RECOMPUTE[choices.recompute or "none"],
    )
    batch, parallel = Batch(args.global_batch, args.seq_len, rows // b), Parallel(dims, **strategy)
    try:
        check(model, batch, parallel, args.precision)  # every rule of the cost model, before any output
    except ValueError as err:
        raise ValueError(f"--layout: {err}") from None
    return batch, parallel


def main(argv=None) -> int:
    args = parse_args(argv)
    assumptions = assumptions_of(args)
    if args.devices:
        console.print(report.devices_table())
        return 0
    if args.published:  # each run priced with its own stack's profile, and any assumption a flag gives
        rows = report.published_rows(overrides_of(args))
        console.print(report.published_table(rows))
        for line in [f"{r['name']}: {r['split']}; {r['assumed']}" for r in rows]:
            console.print("  " + line, highlight=False)
        for stack in STACKS.values():
            console.print(f"  {stack.name}: {stack.software}", highlight=False)
        return 0
    name, model = model_of(args)
    where = cluster(args.gpu, check_cluster(args), args.inter_node_gbps)
    if args.precision not in where.device.peak:
        raise ValueError(f"--precision: the {where.device.name} has no {args.precision} rate (--devices)")
    if args.reserve_gib * GIB >= where.device.memory:  # compared before int(): 1e300 GiB is no integer of bytes
        raise ValueError(f"--reserve-gib: {args.reserve_gib} GiB is all of the {where.device.name}'s memory")
    reserve, choices = int(args.reserve_gib * GIB), choices_of(args)
    layout = layout_of(args, model, choices) if args.layout is not None else None  # refused before any output
    console.print(
        report.header(name, model, args.global_batch * args.seq_len, args.gpus, where, args.precision), highlight=False
    )
    outside = STACKS[args.stack].outside(args.gpu, model.parameters)
    if outside:  # the fitted figures are a guess here: said before the plan, in one line
        console.print(f"warning: outside the fitted regime: {outside}; the time is less certain", highlight=False)
    if layout:
        return _one_layout(args, model, layout, where, reserve, assumptions)
    budget, batch = where.device.memory - reserve, Batch(args.global_batch, args.seq_len)
    found = search(model, batch, args.gpus, where, choices, assumptions, budget)
    if not found:
        least = least_memory(model, batch, args.gpus, where, choices)
        console.print(report.nothing_fits(least, reserve, where.device), highlight=False)
        return 1
    console.print(report.plan_table(found, args.top, budget))
    report.print_assumptions(assumptions, where, reserve)
    if args.plot:
        report.plot(found, args.plot, f"{name} on {args.gpus} x {where.device.name}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump([report.candidate_json(c, reserve, where.device) for c in found], out, indent=1)
    return 0


def _one_layout(args, model, layout: tuple[Batch, Parallel], where, reserve: int, assumptions: Assumptions) -> int:
    batch, parallel = layout
    priced = price(model, batch, parallel, args.precision, where, assumptions)
    result = report.candidate_json(priced, reserve, where.device)
    console.print(report.layout_line(priced, result), highlight=False)
    console.print(report.layout_table(priced, result, where.device))
    console.print(report.time_table(priced))
    report.print_assumptions(assumptions, where, reserve)
    if args.plot:
        report.plot([priced], args.plot, f"{parallel.label()} on {args.gpus} x {where.device.name}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result, out, indent=1)
    return 0 if result["fits"] else 1
