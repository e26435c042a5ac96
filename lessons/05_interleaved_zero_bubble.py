"""Lesson 05: interleaved 1F1B and zero bubble. Shrink the bubble itself, not only the memory.

    torchrun --nproc-per-node 4 lessons/05_interleaved_zero_bubble.py --micro-batches 8

The idea. GPipe and 1F1B idle (P - 1)/(M + P - 1) of every step (lessons 02, 03). Two ways shrink it:
- Interleaving (Narayanan et al. 2021, arXiv 2104.04473): each rank holds v stages of 1/v the
  layers, looped: rank r holds r, r + P, ... (`interleaved-1f1b`).
- Zero bubble (Qi et al. 2023, arXiv 2401.10241): split each backward into I, the gradient of the
  stage's input (on the critical path: stage p - 1 waits for it) and W, the weights' gradient (no
  one waits for it), and run W where 1F1B would idle. ZB-H1 (`zb-h1`) is 1F1B's order with rank r
  holding back r W's; ZB-V (`zbv`) puts two half-size stages on each rank in a V, r and 2P - 1 - r,
  so that the turn of the V (stages P - 1 and P) and its two ends (stages 0 and 2P - 1) share a rank.

The bubbles, in ticks (a tick: one F, I or W of a stage; an unsplit I is 2). Each rank has 3 v M
ticks of work (v stages, M micro-batches, F + I + W). The step is longer by the idle ticks:
- 1F1B: micro-batch 0 needs P - 1 ticks to reach the last rank and its gradient 2 (P - 1) to come
  back; nothing fills them: 3 (P - 1) idle ticks per rank, (P - 1) / (M + P - 1).
- interleaved 1F1B: the same P - 1 hops each way, but a hop is a stage v times shorter: 3 (P - 1)
  small ticks of 3 v M, (P - 1) / (v M + P - 1), for v times the messages.
- ZB-H1 and ZB-V: rank P - 1 cannot start before micro-batch 0 has crossed ranks 0 .. P - 2, so
  every rank idles at least P - 1 ticks; held-back W's fill all the rest: (P - 1) / (3 v M + P - 1)
  (v = 1 and 2), a third of 1F1B's idle ticks for ZB-H1, a sixth (of half-size ticks) for ZB-V.

Memory, in (stage, micro-batch) activations held at once, rank r (an F adds one; an unsplit I or a
W releases one, a split I does not, as W still needs what the forward saved):
- 1F1B: min(P - r - 1, M) warm-up forwards, one more before the first I: min(M, P - r).
- ZB-H1: the same P - r, plus the r W's rank r holds back (each keeps its activations): min(M, P).
- interleaved 1F1B, rounds of g micro-batches (g = P when P | M): the first I on rank r is of its
  last stage for micro-batch 0; before it the rank can forward a round through its first v - 1
  stages ((v - 1) g) and fill the 2 (P - r - 1) ticks that micro-batch 0 needs to reach the last
  rank and come back, then one more: min(v M, (v - 1) g + 2 (P - r - 1) + 1), in stages of 1/v.
- ZB-V: 2 (P - r) - 1 forwards down the V, r (up, down) pairs while the way up arrives, one more up
  before the first W releases anything: 2 (P - r) - 1 + 2 r + 1 = 2P half-size stages on every
  rank, P whole stages: 1F1B's rank-0 memory on every rank, at the floor of the bubble. That is
  what ZB-V is for.

Measured. Every schedule runs twice: on the real CPU (P ranks taking turns on this machine's
cores, where the bubble is not lost time and the extra messages and W's second walk through the
graph cost more than a tick), and on an emulated device (`--emulate-ms`, `distlab/proof/emulate.py`:
each layer's F, I or W costs a fixed time in which the rank sleeps, the real math running inside
it). There the step times follow the grids: ZB-H1 / 1F1B comes out near the ratio of their lengths.

The mechanism: the schedules are data. ZB-H1 is written out below, `zb_h1` (the lesson checks it is
the library's); all of them are in `distlab/model_split/schedules.py` (`interleaved_1f1b`, `zero_bubble`,
`zbv`: warm-up, one forward one backward, cool-down, with W held back);
`distlab/model_split/simulator.py: simulate` places them on a grid of ticks; `distlab/model_split/runner.py:
PipelineStep` executes them, one rank's several stages and their I/W split (`_backward`: the input's
gradient with `torch.autograd.grad(out, x, g, retain_graph=True)`; `_weight`: the weights' later);
`distlab/model_split/p2p.py: comm_plan` batches the messages at the ticks the grid gives them.

The proof. Every schedule, ours and torch.distributed.pipelining's of the same name, trains the same
split model, and its gradients, parameters and losses are compared with the unsplit model trained
on the whole batch in one process. The grids' bubbles and in-flight counts are compared with the
closed forms above, the in-flight counts also with what the runner held while running, and
PyTorch's executed orders with ours.
"""

from __future__ import annotations

from collections import deque

from rich.table import Table

from distlab.model_split.report import check_runs, gathered, orders_table, show_measured
from distlab.model_split.runner import PipelineStep
from distlab.model_split.schedules import SCHEDULES, Action, Schedule, make_schedule
from distlab.model_split.simulator import peak_in_flight, render, simulate
from distlab.model_split.torch_engine import TORCH_SCHEDULES, TorchStep, refusals
from distlab.model_split.training import PipelineConfig, train, unsplit_reference
from distlab.processes.console import print0
from distlab.processes.flags import check_flags_against_world, positive_int, require
from distlab.processes.runtime import distributed, run_main
from distlab.proof.cli import add_emulate_args, add_mlp_args, lesson_parser, mlp_run, stages_fit_layers
from distlab.proof.compare import all_ok, compare
from distlab.proof.timeline import step_seconds
from distlab.proof.verdict import Verdict

# ---- the mechanism: the zero-bubble schedules, and their closed forms ----------------------------

NAMES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zbv")  # ours, and torch's of the same names
SPLIT = ("zb-h1", "zbv")  # I and W split: the floor (P-1)/(3vM+P-1)


def zb_h1(num_ranks: int, microbatches: int) -> Schedule:
    """Rank r: 1F1B's order (min(P - r - 1, M) warm-up forwards, then one forward and one backward in
    turn) with every backward split into I and W, and the W's held back: the oldest waiting W runs
    only once more than r are waiting; the last r run at the end, where 1F1B would idle."""
    schedule = []
    for r in range(num_ranks):
        warmup = min(num_ranks - r - 1, microbatches)
        order, waiting = [Action("F", i, r) for i in range(warmup)], deque()
        for i in range(microbatches):
            if warmup + i < microbatches:
                order.append(Action("F", warmup + i, r))
            order.append(Action("I", i, r))
            waiting.append(Action("W", i, r))
            if len(waiting) > r:
                order.append(waiting.popleft())
        schedule.append(order + list(waiting))
    return schedule


def stages_per_rank(name: str, v: int) -> int:
    return SCHEDULES[name].allowed_v[0] if SCHEDULES[name].allowed_v else v


def formulas(name: str, world: int, m: int, v: int) -> tuple[float | None, list[int] | None]:
    """The closed forms derived in the docstring (ticks F = I = W = 1): the bubble and each rank's
    in-flight count; None where the schedule's form needs a fuller pipeline (M >= P; ZB-V M >= 2P)."""
    g = m // max(1, m // world)  # the interleaved schedule's round of micro-batches
    if m < world or (name == "zbv" and m < 2 * world):
        return None, None
    bubble = (world - 1) / (3 * v * m + world - 1) if name in SPLIT else (world - 1) / (v * m + world - 1)
    held = {
        "gpipe": lambda r: m,
        "1f1b": lambda r: min(m, world - r),
        "zb-h1": lambda r: min(m, world),
        "interleaved-1f1b": lambda r: min(v * m, (v - 1) * g + 2 * (world - r - 1) + 1),
        "zbv": lambda r: 2 * world,
    }[name]
    return bubble, [held(r) for r in range(world)]


# ---- the chapter, part by part -------------------------------------------------------------------


def grids(verdict: Verdict, world: int, m: int, v: int) -> dict:
    """Each schedule's grid on one time axis (a character is half a stage's forward), and its bubble
    and in-flight counts against the closed forms."""
    print0(
        f"\n[bold]The grids[/], P={world}, M={m}: F forward, I input gradient, W weight gradient (II: an "
        "unsplit backward, input and weight gradient together); lower case: a rank's second stage; "
        ". idle. One character: the forward of half a stage (interleaved and V schedules run stages "
        "of half the layers)."
    )
    table = Table(
        title="the grids against the closed forms",
        title_justify="left",
        caption_justify="left",
        caption="length: the step in forwards of a whole stage (ticks / v); in flight: per rank, the "
        "most (stage, micro-batch) activations held; -: no closed form for M < P (ZB-V: M < 2P)",
    )
    for col in ("schedule", "v", "ticks", "length", "bubble", "formula", "in flight", "formula"):
        table.add_column(col, justify="left" if col == "schedule" else "right", overflow="fold")
    out = {}
    for name in NAMES:
        vv = stages_per_rank(name, v)
        schedule = make_schedule(name, world, m, vv)
        timing, held = simulate(schedule), peak_in_flight(schedule)
        bubble, (want, want_held) = timing.bubble_fraction(), formulas(name, world, m, vv)
        print0(render(timing, f"{SCHEDULES[name].title}:", compact=True, stretch=2 // vv))
        table.add_row(
            SCHEDULES[name].title,
            str(vv),
            str(timing.ticks),
            f"{timing.ticks / vv:g}",
            f"{bubble:.4f}",
            "-" if want is None else f"{want:.4f}",
            " ".join(map(str, held)),
            "-" if want_held is None else " ".join(map(str, want_held)),
        )
        out[name] = {
            "v": vv,
            "ticks": timing.ticks,
            "length": timing.ticks / vv,
            "bubble": bubble,
            "formula": want,
            "in_flight": held,
        }
        if want is not None:
            verdict.check(
                f"{SCHEDULES[name].title}: bubble and in-flight counts equal their closed forms",
                abs(bubble - want) < 1e-12 and held == want_held,
                f"bubble {bubble:.4f}",
            )
    print0(table)
    verdict.check(
        "the ZB-H1 order above is the library's (schedules.zero_bubble, v=1)",
        zb_h1(world, m) == make_schedule("zb-h1", world, m),
    )
    return out


def bubble_curve(world: int, v: int) -> dict:
    """Bubble against M, counted in each schedule's grid (the notebook plots it)."""
    ms = [world, 2 * world, 4 * world, 8 * world]
    curve = {
        name: {mm: simulate(make_schedule(name, world, mm, stages_per_rank(name, v))).bubble_fraction() for mm in ms}
        for name in NAMES
    }
    table = Table(title="bubble against M, counted in the grids", title_justify="left")
    for col in ["schedule"] + [f"M={mm}" for mm in ms]:
        table.add_column(col, justify="left" if col == "schedule" else "right", overflow="fold")
    for name, row in curve.items():
        table.add_row(SCHEDULES[name].title, *(f"{b:.3f}" for b in row.values()))
    print0(table)
    return curve


def run_all(rt, cfg: PipelineConfig, engine) -> dict:
    configs = {n: cfg.replace(schedule=n, stages_per_rank=stages_per_rank(n, cfg.stages_per_rank)) for n in NAMES}
    return {n: train(rt, c, engine(rt, c)) for n, c in configs.items()}


def ours_part(rt, cfg: PipelineConfig, ref, verdict: Verdict) -> dict:
    """Our five schedules on the real CPU: exact, and holding what the grids say."""
    ours = run_all(rt, cfg, PipelineStep)
    table, matched = check_runs(
        {SCHEDULES[n].title: r for n, r in ours.items()}, ref, cfg.dtype, "ours against the unsplit model"
    )
    print0(table)
    verdict.check("every schedule of ours gives the unsplit model's gradients, parameters and losses", matched)
    held = {n: [x.peak_in_flight for x in gathered(r)] for n, r in ours.items()}
    verdict.check(
        "the runner held, while running, the in-flight counts of the grids",
        all(held[n] == verdict.figures["grids"][n]["in_flight"] for n in NAMES),
    )
    return ours


def measured_part(rt, cfg: PipelineConfig, args, ours: dict, ref, verdict: Verdict) -> None:
    """Step times on the real CPU and on the emulated device, against the grids' lengths."""
    real = {n: 1e3 * step_seconds(r.spans, cfg.steps) for n, r in ours.items()}
    grid = verdict.figures["grids"]
    caption = "real CPU: P ranks share this machine's cores (see the docstring)"
    emulated = {}
    if args.emulate_ms:
        caption = (
            f"emulated: {args.emulate_ms:g} ms per layer-pass; grid: the length in whole-stage forwards x "
            f"{args.layers / rt.world_size:g} layers x {args.emulate_ms:g} ms; " + caption
        )
        runs = run_all(rt, cfg.replace(emulate_ms=args.emulate_ms), PipelineStep)
        _, matched = check_runs({n: r for n, r in runs.items()}, ref, cfg.dtype)
        verdict.check("on the emulated device every schedule still gives the unsplit model's gradients", matched)
        emulated = {n: 1e3 * step_seconds(r.spans, cfg.steps) for n, r in runs.items()}
        label = f"emulated device, {args.emulate_ms:g} ms per layer-pass"
        shown = {
            n: show_measured(f"{SCHEDULES[n].title}'s last step", {label: runs[n].spans}, rt.world_size, cfg.steps - 1)[
                label
            ]
            for n in ("1f1b", "zb-h1", "zbv")
        }
        verdict.figure("emulated_timelines", shown)
    table = Table(
        title="step time, ms (median over steps 2..)", title_justify="left", caption=caption, caption_justify="left"
    )
    for col in ("schedule", "real CPU", "emulated", "grid", "emul. / 1F1B", "grid / 1F1B"):
        table.add_column(col, justify="left" if col == "schedule" else "right", overflow="fold")
    tick = args.layers / rt.world_size * args.emulate_ms
    for n in NAMES:
        e = emulated.get(n)
        table.add_row(
            SCHEDULES[n].title,
            f"{real[n]:.0f}",
            "-" if e is None else f"{e:.0f}",
            f"{grid[n]['length'] * tick:.0f}",
            "-" if e is None else f"{e / emulated['1f1b']:.2f}",
            f"{grid[n]['length'] / grid['1f1b']['length']:.2f}",
        )
    print0(table)
    verdict.figure(
        "step_ms", {"real": real, "emulated": emulated, "grid": {n: grid[n]["length"] * tick for n in NAMES}}
    )


def parse_args(argv: list[str] | None = None):
    parser = add_mlp_args(lesson_parser(__doc__), layers=16, width=32, global_batch=64, steps=3)
    parser.add_argument("--micro-batches", type=positive_int, default=8, help="M; must divide N (PyTorch's runs)")
    parser.add_argument("--stages-per-rank", type=positive_int, default=2, help="v of interleaved 1F1B (>= 2)")
    add_emulate_args(parser, ms_per_layer=10.0)  # half-size stages: their messages would weigh more at 4 ms
    return parser.parse_args(argv)


def main() -> int:
    args = check_flags_against_world(parse_args(), stages_fit_layers)
    m, v = args.micro_batches, args.stages_per_rank
    require(
        args.global_batch % m == 0,
        "--micro-batches",
        f"M={m} must divide N={args.global_batch} "
        "(--global-batch): PyTorch's schedules take equal micro-batches only (ours: lesson 02)",
    )
    cfg = PipelineConfig(**mlp_run(args), stages_per_rank=v)
    with distributed(args.device) as rt:
        world, verdict = rt.world_size, Verdict(rt)
        print0(
            f"[bold]Lesson 05: interleaved 1F1B and zero bubble[/] - {args.layers} layers on {world} rank(s), "
            f"N={args.global_batch} in M={m} micro-batches, v={v}, {args.dtype}, {rt.backend}"
        )
        verdict.figure("grids", grids(verdict, world, m, v))
        verdict.figure("bubble_curve", bubble_curve(world, v))
        ref = unsplit_reference(cfg)
        ours = ours_part(rt, cfg, ref, verdict)
        measured_part(rt, cfg, args, ours, ref, verdict)
        theirs = torch_part(rt, cfg, ref, verdict)
        verdict.figure("torch_orders", {n: [[a.label for a in o] for o in theirs[n]] for n in theirs})
        return verdict.finish(args.json)


def torch_part(rt, cfg: PipelineConfig, ref, verdict: Verdict) -> dict:
    """torch's schedules of the same names: gradients, orders, and where they differ from ours."""
    world, m = rt.world_size, cfg.micro_batches
    configs = {n: cfg.replace(schedule=n, stages_per_rank=stages_per_rank(n, cfg.stages_per_rank)) for n in NAMES}
    label = {n: TORCH_SCHEDULES[n] + (" v=1" if n == "zb-h1" else "") for n in NAMES}
    refused = {n: refusals(rt, c, sorted(set(range(1, 2 * world + 2)) | {m})) for n, c in configs.items()}
    print0(
        "M that PyTorch's constructors refuse at this P (ours run every M, but for interleaved rounds that do "
        "not divide M): " + "; ".join(f"{label[n]} {sorted(r)}" for n, r in refused.items() if r)
    )
    verdict.figure("refused", {n: sorted(r) for n, r in refused.items()})
    runs = {n: train(rt, c, TorchStep(rt, c)) for n, c in configs.items() if m not in refused[n]}
    table, matched = check_runs(
        {label[n]: r for n, r in runs.items()}, ref, cfg.dtype, "PyTorch's against the unsplit model"
    )
    print0(table)
    verdict.check(
        f"each of PyTorch's schedules that takes M={m} ({len(runs)} of {len(NAMES)}) gives the "
        "unsplit model's gradients, parameters and losses",
        matched,
    )
    both = {n: gathered((r.executed, r.planned)) for n, r in runs.items()}
    executed = {n: [list(e) for e, _ in ranks] for n, ranks in both.items()}
    same = [n for n in runs if executed[n] == make_schedule(n, world, m, configs[n].stages_per_rank)]
    if "zb-h1" in runs:
        print0(
            orders_table(
                {"ours (ZB-H1)": make_schedule("zb-h1", world, m), "PyTorch executed": executed["zb-h1"]},
                "ZB-H1: our order and what PyTorch's InterleavedZeroBubble ran (v=1)",
            )
        )
    print0(f"PyTorch executes our order, rank by rank, for: {', '.join(label[n] for n in same)}")
    verdict.check(
        "PyTorch executes our order for every schedule it runs", same == list(runs), f"{len(same)} of {len(runs)}"
    )
    differs = {n: [r for r, (e, pl) in enumerate(ranks) if list(e) != list(pl)] for n, ranks in both.items()}
    print0(
        "pipeline_order, PyTorch's printed plan, differs from what it runs for: "
        + (", ".join(f"{label[n]} (ranks {d})" for n, d in differs.items() if d) or "none")
    )
    unscaled_cfg = configs["zbv"].replace(steps=1, scale_grads=False)
    unscaled = train(rt, unscaled_cfg, TorchStep(rt, unscaled_cfg))
    want = {n: m * g for n, g in ref.first_grads.items() if n in unscaled.first_grads}
    verdict.check(
        f"ScheduleZBVZeroBubble with scale_grads=False and a mean loss gives M = {m} times the gradient, "
        "as ScheduleGPipe does (lesson 04)",
        all_ok(compare(want, unscaled.first_grads)),
    )
    return executed


if __name__ == "__main__":
    run_main(main)
