"""Lesson 05: interleaved 1F1B and zero bubble. Shrink the bubble itself, not only the memory.

    torchrun --nproc-per-node 4 lessons/05_interleaved_zero_bubble.py --micro-batches 8

The idea. GPipe and 1F1B idle (P - 1)/(M + P - 1) of every step (lessons 02, 03). Two ways shrink it:
- Interleaving (Narayanan et al. 2021, arXiv 2104.04473): each rank holds v stages of 1/v the
  layers, looped: rank r holds r, r + P, ... The pipeline fills and drains in stages v times
  shorter, so the idle time shrinks v times, for v times the messages: (P - 1)/(v M + P - 1).
- Zero bubble (Qi et al. 2023, arXiv 2401.10241): split each backward into B, the gradient of the
  stage's input (on the critical path: stage p - 1 waits for it) and W, the weights' gradient (no
  one waits for it), and run W where 1F1B would idle. With F = I = W = 1 tick, ZB-H1 idles P - 1
  ticks per rank where 1F1B idles 3 (P - 1): a third, at 1F1B's memory (P micro-batches at most).
  ZB-V puts two half-size stages on each rank in a V (r and 2P - 1 - r), so the turn of the V stays
  on one rank: P - 1 ticks of half a stage. Every rank of any schedule here idles at least P - 1
  ticks (rank P - 1 cannot start before), so the zero-bubble schedules sit on that floor:
  (P - 1)/(3 v M + P - 1).

The mechanism: the schedules are data, `distlab/pipeline/schedules.py` (`interleaved_1f1b`,
`zero_bubble`, `zbv`: warm-up, one forward one backward, cool-down, with W held back);
`distlab/pipeline/simulator.py: simulate` places them on a grid of ticks; `distlab/pipeline/runner.py:
PipelineStep` executes them, one rank's several stages and their I/W split (`_backward`: the input's
gradient with `torch.autograd.grad(out, x, g, retain_graph=True)`; `_weight`: the weights' later);
`distlab/pipeline/p2p.py: comm_plan` batches the messages at the ticks the grid gives them.

The proof. Every schedule, ours and each of torch.distributed.pipelining's seven, trains the same
split model, and its gradients, parameters and losses are compared with the unsplit model trained
on the whole batch in one process. The grids' bubbles and in-flight counts are compared with the
closed forms above, the in-flight counts also with what the runner held while running, and
PyTorch's executed orders with ours. Step times are measured too, but on a shared 2-core CPU with
P ranks they say little about the grids: ranks share cores (an idle rank lends its core), and
interleaving's extra messages and W's second walk through the graph cost more than a tick here.
"""

from __future__ import annotations

from rich.table import Table

from distlab.cli import add_mlp_args, lesson_parser, positive_int, require
from distlab.compare import all_ok, compare
from distlab.console import print0
from distlab.pipeline.report import check_runs, gathered, orders_table
from distlab.pipeline.runner import PipelineStep
from distlab.pipeline.schedules import SCHEDULES, make_schedule
from distlab.pipeline.simulator import peak_in_flight, render, simulate
from distlab.pipeline.torch_engine import TORCH_SCHEDULES, TorchStep, refusals
from distlab.pipeline.training import PipelineConfig, train, unsplit_reference
from distlab.runtime import distributed, run_main
from distlab.timeline import step_seconds
from distlab.verdict import Verdict

SHOWN = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zbv")   # the grids side by side
OURS = SHOWN + ("interleaved-zb", "looped-bfs")                   # every schedule of ours
THEIRS = OURS + ("dualpipev",)                                    # torch's seven (InterleavedZeroBubble twice)


def stages_per_rank(name: str, v: int) -> int:
    return SCHEDULES[name].allowed_v[0] if name in SCHEDULES and SCHEDULES[name].allowed_v else v


def formulas(name: str, p: int, m: int, v: int) -> tuple[float | None, list[int] | None]:
    """The closed forms (unit ticks F = I = W = 1) of the bubble and of each rank's in-flight count;
    None where the schedule's form needs a fuller pipeline (M >= P; ZB-V M >= 2P)."""
    g = m // max(1, m // p)  # the interleaved schedules' round of micro-batches
    if m < p or (name == "zbv" and m < 2 * p):
        return None, None
    bubble = (p - 1) / (v * m + p - 1) if name in ("gpipe", "1f1b", "interleaved-1f1b", "looped-bfs") \
        else (p - 1) / (3 * v * m + p - 1)
    held = {"gpipe": lambda r: m, "1f1b": lambda r: min(m, p - r), "looped-bfs": lambda r: v * m,
            "interleaved-1f1b": lambda r: min(v * m, (v - 1) * g + 2 * (p - r - 1) + 1),
            "zb-h1": lambda r: min(m, p), "interleaved-zb": lambda r: min(v * m, (v - 1) * g + p),
            "zbv": lambda r: 2 * p}[name]
    return bubble, [held(r) for r in range(p)]


def grids(verdict: Verdict, p: int, m: int, v: int) -> dict:
    """Each schedule's grid on one time axis (a character is half a stage's forward), and its bubble
    and in-flight counts against the closed forms."""
    print0(f"\n[bold]The grids[/], P={p}, M={m}: F forward, B input gradient, W weight gradient (BB: an "
           "unsplit backward); lower case: a rank's second stage; . idle. One character: the forward of "
           "half a stage (interleaved and V schedules run stages of half the layers).")
    table = Table(title="the grids against the closed forms", title_justify="left", caption_justify="left",
                  caption="T: the step's length in forwards of a whole stage (ticks / v); in flight: per rank, "
                  "the most (stage, micro-batch) activations held; -: no closed form for M < P (ZB-V: M < 2P)")
    for col in ("schedule", "v", "ticks", "T", "bubble", "formula", "in flight", "formula"):
        table.add_column(col, justify="left" if col == "schedule" else "right", overflow="fold")
    out = {}
    for name in OURS:
        vv = stages_per_rank(name, v)
        schedule = make_schedule(name, p, m, vv)
        timing, held = simulate(schedule), peak_in_flight(schedule)
        bubble, (want, want_held) = timing.bubble_fraction(), formulas(name, p, m, vv)
        if name in SHOWN:
            print0(render(timing, f"{SCHEDULES[name].title}:", compact=True, stretch=2 // vv))
        table.add_row(SCHEDULES[name].title, str(vv), str(timing.ticks), f"{timing.ticks / vv:g}", f"{bubble:.4f}",
                      "-" if want is None else f"{want:.4f}", " ".join(map(str, held)),
                      "-" if want_held is None else " ".join(map(str, want_held)))
        out[name] = {"v": vv, "ticks": timing.ticks, "bubble": bubble, "formula": want, "in_flight": held}
        if want is not None:
            verdict.check(f"{SCHEDULES[name].title}: bubble and in-flight counts equal their closed forms",
                          abs(bubble - want) < 1e-12 and held == want_held, f"bubble {bubble:.4f}")
    print0(table)
    return out


def bubble_curve(p: int, v: int) -> dict:
    """Bubble against M, counted in each schedule's grid (the notebook plots it)."""
    ms = [p, 2 * p, 4 * p, 8 * p]
    curve = {name: {mm: simulate(make_schedule(name, p, mm, stages_per_rank(name, v))).bubble_fraction()
                    for mm in ms} for name in SHOWN}
    table = Table(title="bubble against M, counted in the grids", title_justify="left")
    for col in ["schedule"] + [f"M={mm}" for mm in ms]:
        table.add_column(col, justify="left" if col == "schedule" else "right", overflow="fold")
    for name, row in curve.items():
        table.add_row(SCHEDULES[name].title, *(f"{b:.3f}" for b in row.values()))
    print0(table)
    return curve


def run_all(rt, cfg: PipelineConfig, names, engine) -> dict:
    configs = {n: cfg.replace(schedule=n, stages_per_rank=stages_per_rank(n, cfg.stages_per_rank)) for n in names}
    return {n: train(rt, c, engine(rt, c)) for n, c in configs.items()}


def parse_args(argv: list[str] | None = None):
    parser = add_mlp_args(lesson_parser(__doc__), layers=16, width=32, global_batch=64, steps=3)
    parser.add_argument("--micro-batches", type=positive_int, default=8, help="M; must divide N (PyTorch's runs)")
    parser.add_argument("--stages-per-rank", type=positive_int, default=2, help="v of the interleaved schedules (>= 2)")
    return parser.parse_args(argv)


def main() -> int:
    args = parse_args()
    m, v = args.micro_batches, args.stages_per_rank
    require(args.global_batch % m == 0, "--micro-batches", f"M={m} must divide N={args.global_batch} "
            "(--global-batch): PyTorch's schedules take equal micro-batches only (ours: lesson 02)")
    cfg = PipelineConfig.from_args(args, stages_per_rank=v)
    with distributed(args.device) as rt:
        p, verdict = rt.world_size, Verdict(rt)
        print0(f"[bold]Lesson 05: interleaved 1F1B and zero bubble[/] - {args.layers} layers on {p} rank(s), "
               f"N={args.global_batch} in M={m} micro-batches, v={v}, {args.dtype}, {rt.backend}")
        verdict.figure("grids", grids(verdict, p, m, v))
        verdict.figure("bubble_curve", bubble_curve(p, v))
        ref = unsplit_reference(cfg)
        ours = run_all(rt, cfg, OURS, PipelineStep)
        table, matched = check_runs({SCHEDULES[n].title: r for n, r in ours.items()}, ref, cfg.dtype, "ours against "
                                    "the unsplit model")
        print0(table)
        verdict.check("every schedule of ours gives the unsplit model's gradients, parameters and losses", matched)
        held = {n: [x.peak_in_flight for x in gathered(r)] for n, r in ours.items()}
        verdict.check("the runner held, while running, the in-flight counts of the grids",
                      all(held[n] == verdict.figures["grids"][n]["in_flight"] for n in OURS))
        times = verdict.figure("step_ms", {n: 1e3 * step_seconds(r.spans, args.steps) for n, r in ours.items()})
        print0("step time of ours, median over steps 2..: " + ", ".join(f"{SCHEDULES[n].title} {t:.0f} ms"
               for n, t in times.items()) + f" ({p} ranks on this CPU's cores: see the docstring's caveat)")
        theirs = torch_part(rt, cfg, ref, verdict)
        verdict.figure("torch_orders", {n: [[a.label for a in o] for o in theirs[n]] for n in theirs})
        return verdict.finish(args.json)


def torch_part(rt, cfg: PipelineConfig, ref, verdict: Verdict) -> dict:
    """torch's seven schedules: gradients, orders, and where they differ from ours."""
    p, m = rt.world_size, cfg.micro_batches
    configs = {n: cfg.replace(schedule=n, stages_per_rank=stages_per_rank(n, cfg.stages_per_rank)) for n in THEIRS}
    label = {n: TORCH_SCHEDULES[n] + (f" v={c.stages_per_rank}" if n in ("zb-h1", "interleaved-zb") else "")
             for n, c in configs.items()}
    refused = {n: refusals(rt, c, sorted(set(range(1, 2 * p + 2)) | {m})) for n, c in configs.items()}
    print0("M that PyTorch's constructors refuse at this P (ours run every M, but for interleaved rounds that do "
           "not divide M): " + "; ".join(f"{label[n]} {sorted(r)}" for n, r in refused.items() if r))
    verdict.figure("refused", {n: sorted(r) for n, r in refused.items()})
    runs = {n: train(rt, c, TorchStep(rt, c)) for n, c in configs.items() if m not in refused[n]}
    table, matched = check_runs({label[n]: r for n, r in runs.items()}, ref, cfg.dtype, "PyTorch's against the "
                                "unsplit model")
    print0(table)
    classes = len({TORCH_SCHEDULES[n] for n in runs})
    verdict.check(f"each of PyTorch's schedules that takes M={m} ({len(runs)} runs, {classes} classes) gives the "
                  "unsplit model's gradients, parameters and losses", matched)
    both = {n: gathered((r.executed, r.planned)) for n, r in runs.items()}
    executed = {n: [list(e) for e, _ in ranks] for n, ranks in both.items()}
    shared = [n for n in OURS if n in runs]
    same = [n for n in shared if executed[n] == make_schedule(n, p, m, configs[n].stages_per_rank)]
    if "zb-h1" in runs:
        print0(orders_table({"ours (ZB-H1)": make_schedule("zb-h1", p, m), "PyTorch executed": executed["zb-h1"]},
                            "ZB-H1: our order and what PyTorch's InterleavedZeroBubble ran (v=1)"))
    print0(f"PyTorch executes our order, rank by rank, for: {', '.join(label[n] for n in same)}")
    verdict.check("PyTorch executes our order for every schedule we share with it", same == shared,
                  f"{len(same)} of {len(shared)}")
    differs = {n: [r for r, (e, pl) in enumerate(ranks) if list(e) != list(pl)] for n, ranks in both.items()}
    print0("pipeline_order, PyTorch's printed plan, differs from what it runs for: "
           + (", ".join(f"{label[n]} (ranks {d})" for n, d in differs.items() if d) or "none"))
    if "dualpipev" in runs:  # one of PyTorch's own, on our grid
        dual = simulate(executed["dualpipev"])
        print0(render(dual, f"DualPipeV as PyTorch executed it, on our grid (bubble {dual.bubble_fraction():.4f}):",
                      compact=True))
        verdict.figure("dualpipev", {"bubble": dual.bubble_fraction(), "ticks": dual.ticks})
    unscaled_cfg = configs["zbv"].replace(steps=1, scale_grads=False)
    unscaled = train(rt, unscaled_cfg, TorchStep(rt, unscaled_cfg))
    want = {n: m * g for n, g in ref.first_grads.items() if n in unscaled.first_grads}
    verdict.check(f"ScheduleZBVZeroBubble with scale_grads=False and a mean loss gives M = {m} times the gradient, "
                  "as ScheduleGPipe does (lesson 04)", all_ok(compare(want, unscaled.first_grads)))
    return executed


if __name__ == "__main__":
    run_main(main)
