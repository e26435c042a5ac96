"""Lesson 19: DualPipeV, the V-shaped pipeline of DeepSeek-V3 in which one micro-batch's forward runs as a
pair with another's backward, written as data and run by this repository's schedule runner; then DualPipe
itself, in both directions, with two copies of the parameters and a runner for two opposite chains.

    torchrun --nproc-per-node 4 lessons/19_dualpipe.py --micro-batches 8    # P = 2 or 4, M even, M >= 2P

The idea. ZB-V (lesson 05) puts two half-size stages on each rank in a V, a = r down and b = 2P - 1 - r up,
and splits each backward into I (the input's gradient) and W (the weights'). DualPipe (DeepSeek-V3, arXiv
2412.19437) keeps the V's placement and, in its steady state, runs the forward of one micro-batch on one
stage and the backward of another on the other stage as ONE unit, a pair: on DeepSeek's GPUs each half's
all-to-all (expert parallelism) and pipeline messages run while the other half computes, so a step's
communication hides inside its own compute. DualPipeV is DualPipe "cut in half": one copy of the
parameters on a V, instead of two copies running in both directions.

The order, rank r (a and b its two stages; F forward, B a full backward, I and W split; (X, Y) a pair):
    1. 2 (P - r - 1) x F(a)                   the way down fills up
    2. r + 1 x F(a), F(b)                     the turn of the V
    3. P - r - 1 x I(b), W(b), F(b)           the way up, zero-bubble style
    4. M - 2P + r + 1 x (F(a), B(b)), (F(b), B(a))   the steady state: pairs (rank P - 1's first unpaired)
    5. P - r - 1 x B(b), (F(b), B(a))         forwards run out
    6. r + 1 x B(b), B(a)                     the second half of them split into I and a W held back
    7. P - r - 1 x W, then B(a) or I(a)
    8. r + 1 x W                              the W's held back fill the drain
It needs M >= 2P (phase 4 runs M - 2P + r + 1 >= 1 times on rank 0): torch's ScheduleDualPipeV refuses less.

The bubble, on the unit grid (F = I = W = 1 tick of a half-size stage, a full B = 2, a pair = F + B):
each rank has 2 x M x 3 = 6M ticks of work. Rank P - 1 holds stages P - 1 and P, the turn of the V, and
cannot start before micro-batch 0 has crossed ranks 0 .. P - 2: P - 1 ticks. On the way back the split I's
and the held-back W's fill every other gap, so every rank idles exactly P - 1 ticks:

    bubble = (P - 1) / (6M + P - 1)        ZB-V's floor (lesson 05, v = 2); 1F1B's (P - 1)/(M + P - 1)

In flight, rank r: phases 1 and 2 forward 2 (P - r - 1) + 2 (r + 1) = 2P (stage, micro-batch) pairs before
any backward; phase 3's I releases nothing (W still needs the activations), its W releases one, its F adds
one: 2P. In a pair the forward runs first and its backward releases only after: 2P + 1 at the peak, on
every rank. In whole stages P + 1/2: ZB-V's P plus the half stage that overlapping costs (DeepSeek counts
PP + 1 for DualPipe, whose ranks hold two whole stages).

The mechanism is `dualpipev` below: a pure function returning, per rank, its ticks, each a tuple of one
action or a pair. `flatten` hands the runner (`distlab.model_split.runner.PipelineStep`) the actions in order,
a pair as its forward then its backward; the simulator (`distlab.model_split.simulator`) draws its grid.

DualPipe in both directions (`dualpipe`; the runner for two chains: `distlab.model_split.two_chains`). Two
copies of the model, each cut in P whole chunks (1/P of the model). Chain 0 runs copy 0 with chunk k on rank
k: its M/2 micro-batches enter at rank 0. Chain 1 runs copy 1 with chunk k on rank P - 1 - k: its M/2
micro-batches enter at rank P - 1. So rank r holds chunk r of copy 0 and chunk P - 1 - r of copy 1, and its
mirror P - 1 - r holds the same two chunks, each in the other copy: one exchange of both chunks' gradients
and a sum (a + b there, b + a here: equal bit for bit) gives each copy the whole batch's gradient, and the
copies step identically and stay equal.
P must be even (no rank is its own mirror) and M even (M/2 from each end), M >= 2P.
The order: fold the V. Chain 0's positions 0 .. P/2 - 1 (ranks 0 .. P/2 - 1) and P/2 .. P - 1 (ranks
P - 1 .. P/2, read from the far end) are a V on H = P/2 "ranks" h = min(r, P - 1 - r), its a stage on rank
h and its b stage on the mirror; chain 1 is the same V mirrored. Rank r runs DualPipeV(H, M/2)'s order of
V-rank h, its a stage read as position h of its OWN chain (the one entering at its end) and its b as
position P - 1 - h of the other. Both mirrors run one order on one clock, so each chain runs exactly as
the V would (induction over the ticks), and every figure of the V carries over with P -> P/2, M -> M/2:
    bubble = (P/2 - 1) / (3M + P/2 - 1)   per rank 3M ticks of work (2 chunks x M/2 x (F + I + W)) and
                                          P/2 - 1 idle: the V's turn, now half as far from either end
    in flight = 2 (P/2) + 1 = P + 1       whole-chunk activations, on every rank
DeepSeek-V3 (Table 2) states bubble (PP/2 - 1)(F&B + B - 3W) and activations PP + 1 (a rank's chunk each).
The activations agree exactly: P + 1. The bubble: our grid lets a pair's forward hand on its output as soon
as that half ends; DeepSeek's F&B is one unit whose two halves interleave (each hiding the other's
messages), so both results come out at its end. Simulated that way (`simulate_units(..., together=True)`),
every rank idles exactly (P/2 - 1)(F&B + B - 3W) ticks when F = I = W = 1 tick and F&B = F + B = 3 (the
pair no faster than its halves): 2 (P/2 - 1), twice the split grid's P/2 - 1. With a faster pair (F&B = 2
or 2.5 ticks) the formula is the idle time of the worst rank, the one that sets the step; with I != W it
is neither (an estimate): the tests pin each of these cases for P = 4, 6, 8.

The proof. The flattened schedule trains the split MLP and its gradients, parameters and losses equal the
unsplit model's on the whole batch in one process (float64). torch's `ScheduleDualPipeV` trains it too, and
the order it executes (recorded, lesson 05) is ours, rank by rank. The grid's bubble and each rank's
in-flight count equal the closed forms above, beside ZB-V and 1F1B; on the emulated device (`--emulate-ms`)
the three step times follow their grids. Not modelled: the emulated device charges nothing for a message,
so the pair's hidden communication, DualPipe's own gain on a GPU cluster, is not timed here.
DualPipe, on its own runner: gradients, parameters and losses equal the unsplit model's (float64), the two
copies of every chunk equal bit for bit after training, and its grid's bubble and in-flight counts equal the
closed forms, beside the V's and 1F1B's. The two-chain runner posts its sends without waiting and receives
each peer's messages in the peer's order: it needs no message tags (run here on gloo).
"""

from __future__ import annotations

import argparse
from collections import deque

import torch

from distlab.model_split.report import check_runs, gathered
from distlab.model_split.runner import PipelineStep
from distlab.model_split.schedules import Action, Schedule, make_schedule
from distlab.model_split.simulator import Timing, peak_in_flight, render, simulate
from distlab.model_split.torch_engine import TorchStep
from distlab.model_split.training import PipelineConfig, train, unsplit_reference
from distlab.model_split.two_chains import (
    UNIT,
    TwoChainStep,
    simulate_units,
    two_chain_dependencies,
    unit_timing,
)
from distlab.processes.console import compact_table, print0
from distlab.processes.flags import check_flags_against_world, positive_int, require
from distlab.processes.runtime import distributed, run_main
from distlab.proof.cli import add_emulate_args, add_mlp_args, lesson_parser, mlp_run, stages_fit_layers
from distlab.proof.timeline import step_seconds
from distlab.proof.verdict import Verdict

Ticks = list[list[tuple[Action, ...]]]  # ticks[r] = rank r's units in order: one action, or a pair (F, B)


# ---- the mechanism: DualPipeV as data --------------------------------------------------------------


class _Rank:
    """One rank's order under construction: the next micro-batch of each (kind, stage), and the W's held back."""

    def __init__(self):
        self.ticks: list[tuple[Action, ...]] = []
        self.count: dict[tuple[str, int], int] = {}
        self.waiting: deque[Action] = deque()

    def next(self, kind: str, stage: int) -> Action:
        i = self.count.get((kind, stage), 0)
        self.count[kind, stage] = i + 1
        return Action(kind, i, stage)

    def split(self, stage: int) -> Action:
        """I, its W held back (a full backward is an I with no W: `next("I", stage)`)."""
        i = self.next("I", stage)
        self.waiting.append(Action("W", i.microbatch, stage))
        return i

    def add(self, *actions: Action) -> None:
        self.ticks.append(tuple(actions))

    def weight(self) -> None:
        """The oldest held-back W, if one is waiting."""
        if self.waiting:
            self.add(self.waiting.popleft())


def check_microbatches(num_ranks: int, microbatches: int) -> None:
    if microbatches < 2 * num_ranks:
        raise ValueError(
            f"--micro-batches: DualPipeV needs M >= 2P = {2 * num_ranks} (its steady state runs M - 2P + r + 1 "
            f"times on rank r), got M = {microbatches}"
        )


def dualpipev(num_ranks: int, microbatches: int) -> Ticks:
    """The eight phases of the docstring, rank by rank: stage a = r down the V, b = 2P - 1 - r up."""
    check_microbatches(num_ranks, microbatches)
    P, M, every = num_ranks, microbatches, []
    for r in range(P):
        a, b, me = r, 2 * P - 1 - r, _Rank()
        for _ in range(2 * (P - r - 1)):  # 1. down
            me.add(me.next("F", a))
        for _ in range(r + 1):  # 2. the turn
            me.add(me.next("F", a))
            me.add(me.next("F", b))
        for _ in range(P - r - 1):  # 3. up, zero-bubble style
            me.add(me.split(b))
            me.weight()
            me.add(me.next("F", b))
        for k in range(M - 2 * P + r + 1):  # 4. the steady state: pairs
            if k == 0 and r == P - 1:  # the turn's own micro-batch: its backward needs this forward first
                me.add(me.next("F", a))
                me.add(me.next("I", b))
            else:
                me.add(me.next("F", a), me.next("I", b))
            me.add(me.next("F", b), me.next("I", a))
        for _ in range(P - r - 1):  # 5. forwards run out
            me.add(me.next("I", b))
            me.add(me.next("F", b), me.next("I", a))
        split = False
        for k in range(r + 1):  # 6. the backwards, the second half split
            split = split or (k == (r + 1) // 2 and r % 2 == 1)
            me.add(me.split(b) if split else me.next("I", b))
            split = split or (k == (r + 1) // 2 and r % 2 == 0)
            me.add(me.split(a) if split else me.next("I", a))
        for _ in range(P - r - 1):  # 7.
            me.weight()
            me.add(me.split(a) if split else me.next("I", a))
        for _ in range(r + 1):  # 8. the held-back W's fill the drain
            me.weight()
        every.append(me.ticks)
    return every


def flatten(ticks: Ticks) -> Schedule:
    """The runner's schedule: every rank's actions in order, a pair as its forward, then its backward."""
    return [[action for unit in order for action in unit] for order in ticks]


# ---- DualPipe in both directions: two copies, two chains, one V each ----------------------------


def check_dualpipe(num_ranks: int, microbatches: int) -> None:
    """DualPipe's input rules, checked from what every rank knows (the same line everywhere)."""
    if num_ranks % 2:
        raise ValueError(
            f"--nproc-per-node: DualPipe pairs rank r with rank P - 1 - r (their mirrored copies), so P must be "
            f"even, got P = {num_ranks}"
        )
    if microbatches % 2 or microbatches < 2 * num_ranks:
        raise ValueError(
            f"--micro-batches: DualPipe feeds M/2 micro-batches from each end and needs M even and M >= 2P = "
            f"{2 * num_ranks}, got M = {microbatches}"
        )


def dualpipe(num_ranks: int, microbatches: int) -> Ticks:
    """DualPipe on P ranks and M micro-batches: the order of DualPipeV on H = P/2 ranks and M/2
    micro-batches, run by rank r and by its mirror P - 1 - r alike (h = min(r, P - 1 - r) plays V-rank
    h), its two stages relabelled. The V's a = h becomes position h of the rank's OWN chain (the one
    entering at its end: chain 0 for r < H, chain 1 for r >= H), the V's b = P - 1 - h position P - 1 - h
    of the OTHER chain. Actions are spelled Action(kind, i, stage) with stage = d P + k (position k of
    chain d) and i = d M/2 + j (chain d's j-th micro-batch): one stage and one micro-batch per name."""
    check_dualpipe(num_ranks, microbatches)
    P, half = num_ranks, microbatches // 2
    v_order = dualpipev(P // 2, half)
    every = []
    for r in range(P):
        h, own = min(r, P - 1 - r), int(r >= P // 2)

        def relabel(a: Action, h=h, own=own) -> Action:
            d = own if a.stage == h else 1 - own  # the V's a stage: the own chain; its b: the other
            return Action(a.kind, d * half + a.microbatch, d * P + a.stage)

        every.append([tuple(relabel(a) for a in unit) for unit in v_order[h]])
    return every


# ---- the chapter ---------------------------------------------------------------------------------


def dualpipe_timing(world: int, m: int) -> Timing:
    """DualPipe's grid on the unit costs, its pairs run as forward then backward (the runner's way)."""
    return unit_timing(dualpipe(world, m), lambda a: two_chain_dependencies(a, world))


def dualpipe_step(rt, cfg: PipelineConfig, sum_mirrors: bool = True) -> TwoChainStep:
    """DualPipe's order on the two-chain runner (`sum_mirrors=False`: the twin that skips the mirrors' sum)."""
    check_dualpipe(rt.world_size, cfg.micro_batches)
    return TwoChainStep(rt, cfg, dualpipe(rt.world_size, cfg.micro_batches), sum_mirrors)


def dualpipe_formulas(world: int, m: int) -> tuple[float, list[int]]:
    """Bubble (P/2 - 1)/(3M + P/2 - 1) and P + 1 whole-stage activations on every rank (the V's on P/2 ranks)."""
    h = world // 2
    return (h - 1) / (3 * m + h - 1), [world + 1] * world


def deepseek_bubble(world: int, cost: dict[str, float]) -> float:
    """DeepSeek-V3's Table 2: DualPipe's bubble (PP/2 - 1)(F&B + B - 3W), a time per rank."""
    return (world // 2 - 1) * (cost["FB"] + cost["B"] - 3 * cost["W"])


NAMES = ("1f1b", "zbv", "dualpipev")
TITLES = {"1f1b": "1F1B", "zbv": "ZB-V", "dualpipev": "DualPipeV"}


def schedule_of(name: str, world: int, m: int) -> Schedule:
    return (
        flatten(dualpipev(world, m))
        if name == "dualpipev"
        else make_schedule(name, world, m, 2 if name == "zbv" else 1)
    )


def formulas(name: str, world: int, m: int) -> tuple[float, list[int]]:
    """The closed forms (ticks of a half-size stage for the V's; of a whole stage for 1F1B)."""
    if name == "1f1b":
        return (world - 1) / (m + world - 1), [min(m, world - r) for r in range(world)]
    extra = 1 if name == "dualpipev" else 0  # the pair's forward before its backward's release
    return (world - 1) / (6 * m + world - 1), [2 * world + extra] * world


def grids(verdict: Verdict, world: int, m: int) -> dict:
    print0(
        f"\n[bold]1. The grids[/], P = {world}, M = {m}: F forward, I input gradient (II: a full backward), "
        "W weight gradient; lower case a rank's second stage; . idle; 1F1B's stages twice as long"
    )
    out = compact_table(
        "Bubble and in-flight activations, from the grid and by the closed forms",
        ("schedule", "ticks", "bubble", "formula", "in flight", "formula"),
        caption="in flight: (stage, micro-batch) activations held at once, per rank (half-size stages for the V's); "
        "DualPipe's ticks and stages are whole (1/P of a copy of the model), as 1F1B's",
    )
    shown, ok = {}, []
    for name in NAMES:
        schedule = schedule_of(name, world, m)
        timing = simulate(schedule)
        bubble, held = timing.bubble_fraction(), peak_in_flight(schedule)
        want_bubble, want_held = formulas(name, world, m)
        ok.append(abs(bubble - want_bubble) < 1e-12 and held == want_held)
        print0(render(timing, TITLES[name], compact=True, stretch=2 if name == "1f1b" else 1))
        out.add_row(TITLES[name], str(timing.ticks), f"{bubble:.4f}", f"{want_bubble:.4f}", str(held), str(want_held))
        shown[name] = {"ticks": timing.ticks, "bubble": bubble, "in_flight": held}
    if world % 2 == 0:  # DualPipe: two chains of P whole stages (its grid is drawn in section 4)
        timing = dualpipe_timing(world, m)
        want_bubble, want_held = dualpipe_formulas(world, m)
        held = peak_in_flight(flatten(dualpipe(world, m)))
        ok.append(abs(timing.bubble_fraction() - want_bubble) < 1e-12 and held == want_held)
        row = (f"{timing.bubble_fraction():.4f}", f"{want_bubble:.4f}", f"{held} whole", f"{want_held} whole")
        out.add_row("DualPipe", str(timing.ticks), *row)
    print0(out)
    pairs = [sum(len(unit) == 2 for unit in order) for order in dualpipev(world, m)]
    print0(f"DualPipeV's overlapped (F, B) pairs per rank: {pairs}")
    verdict.check("bubbles and in-flight counts of DualPipe, DualPipeV, ZB-V and 1F1B = their closed forms", all(ok))
    return shown


def ours_and_torch(rt, cfg: PipelineConfig, verdict: Verdict) -> None:
    print0("\n[bold]2. Training the split MLP: our DualPipeV on our runner, and torch's ScheduleDualPipeV[/]")
    world, m = rt.world_size, cfg.micro_batches
    ref, ours_order = unsplit_reference(cfg), flatten(dualpipev(world, m))
    v_cfg = cfg.replace(schedule="dualpipev", stages_per_rank=2)
    ours = train(rt, v_cfg, PipelineStep(rt, v_cfg, ours_order))
    theirs = train(rt, v_cfg, TorchStep(rt, v_cfg))
    table, matched = check_runs({"DualPipeV (ours)": ours, "ScheduleDualPipeV (torch)": theirs}, ref, cfg.dtype)
    print0(table)
    executed = [list(e) for e in gathered(theirs.executed)]
    held = [x.peak_in_flight for x in gathered(ours)]
    print0(f"rank 0's order, ours:   {' '.join(a.label for a in ours_order[0][:12])} ...")
    print0(f"rank 0's, torch ran:    {' '.join(a.label for a in executed[0][:12])} ...")
    verdict.check("DualPipeV, ours and torch's, = the unsplit model (grads, params, losses)", matched)
    verdict.check("torch's ScheduleDualPipeV executes our order, rank by rank", executed == ours_order)
    verdict.check("our runner held the grid's in-flight counts", held == peak_in_flight(ours_order))


def emulated(rt, cfg: PipelineConfig, args, shown: dict, verdict: Verdict) -> None:
    """The three schedules on the emulated device: exact still, and their step times beside their grids."""
    print0(f"\n[bold]3. On the emulated device[/]: {args.emulate_ms:g} ms per layer-pass, messages free")
    tick = args.layers / (2 * rt.world_size) * args.emulate_ms  # one half-size stage's forward
    out = compact_table(
        "Step time (median after the first step) beside the grid",
        ("schedule", "measured ms", "grid ms", "/ 1F1B", "grid / 1F1B"),
        caption="grid: ticks x one half-size stage's forward (1F1B's ticks are whole stages: x 2)",
    )
    measured, runs = {}, {}
    for name in NAMES:
        run_cfg = cfg.replace(schedule=name, stages_per_rank=1 if name == "1f1b" else 2, emulate_ms=args.emulate_ms)
        step = PipelineStep(rt, run_cfg, schedule_of(name, rt.world_size, cfg.micro_batches))
        runs[TITLES[name]] = run = train(rt, run_cfg, step)
        measured[name] = 1e3 * step_seconds(run.spans, cfg.steps)
    _, matched = check_runs(runs, unsplit_reference(cfg), cfg.dtype)
    grid = {n: shown[n]["ticks"] * tick * (2 if n == "1f1b" else 1) for n in NAMES}
    for n in NAMES:
        out.add_row(
            TITLES[n],
            f"{measured[n]:.0f}",
            f"{grid[n]:.0f}",
            f"{measured[n] / measured['1f1b']:.2f}",
            f"{grid[n] / grid['1f1b']:.2f}",
        )
    print0(out)
    verdict.figure("emulated_ms", measured)
    verdict.check("on the emulated device all three still give the unsplit model's gradients", matched)


def both_directions(rt, cfg: PipelineConfig, verdict: Verdict) -> dict:
    """DualPipe proper: its grid, its counts against the closed forms and DeepSeek's, and the two copies trained."""
    world, m = rt.world_size, cfg.micro_batches
    print0(
        f"\n[bold]4. DualPipe in both directions[/], P = {world}, M = {m} (M/2 from each end): upper case "
        "copy 0 (rows enter at rank 0), lower case copy 1 (rows enter at rank P - 1); stages of 1/P of the model"
    )
    timing, ticks = dualpipe_timing(world, m), dualpipe(world, m)
    print0(render(timing, "DualPipe", compact=True, stretch=2))
    bubble, held = timing.bubble_fraction(), peak_in_flight(flatten(ticks))
    want_bubble, want_held = dualpipe_formulas(world, m)
    _, idle, _ = simulate_units(ticks, lambda a: two_chain_dependencies(a, world), UNIT, together=True)
    print0(
        f"grid: {timing.ticks} ticks, bubble {bubble:.4f} (formula {want_bubble:.4f}), in flight {held} "
        f"(formula {want_held[0]} each); pairs as one unit (DeepSeek's F&B = 3 ticks): idle {max(idle):g} "
        f"ticks a rank, DeepSeek's (P/2 - 1)(F&B + B - 3W) = {deepseek_bubble(world, UNIT):g}"
    )
    verdict.check(
        "DualPipe's bubble and in-flight counts = their closed forms (the V's on P/2 ranks; P + 1 = DeepSeek's)",
        abs(bubble - want_bubble) < 1e-12 and held == want_held,
    )
    verdict.check(
        "with each pair one unit, every rank idles DeepSeek's (P/2 - 1)(F&B + B - 3W)",
        set(idle) == {deepseek_bubble(world, UNIT)},
    )
    run = train(rt, cfg, dualpipe_step(rt, cfg))
    table, matched = check_runs({"DualPipe (two copies, mirrors summed)": run}, unsplit_reference(cfg), cfg.dtype)
    print0(table)
    params = gathered(run.params)  # every rank's, on every rank: the same verdict everywhere
    same = all(torch.equal(t, params[world - 1 - r][n]) for r in range(world) for n, t in params[r].items())
    verdict.check("DualPipe's two copies, each chunk's gradient summed with its mirror's, = the unsplit model", matched)
    verdict.check("the two copies of every chunk are equal bit for bit after training", same)
    verdict.check(
        "the two-chain runner held the grid's in-flight counts", [x.peak_in_flight for x in gathered(run)] == held
    )
    return {"ticks": timing.ticks, "bubble": bubble, "in_flight": held, "idle_as_units": max(idle)}


def parse_args():
    parser = add_mlp_args(lesson_parser(__doc__), layers=16, width=16, global_batch=32, steps=2)
    parser.add_argument("--micro-batches", type=positive_int, default=8, help="M; at least 2P, and dividing N")
    add_emulate_args(parser, ms_per_layer=10.0)
    return parser.parse_args()


def world_rules(args, world_size: int) -> None:
    stages_fit_layers(argparse.Namespace(**vars(args), stages_per_rank=2), world_size)  # the V: 2 stages a rank
    m, n = args.micro_batches, args.global_batch
    require(n % m == 0, "--micro-batches", f"M = {m} must divide N = {n} (torch's schedules take equal micro-batches)")
    check_microbatches(world_size, m)  # M >= 2P, the same line on every rank
    check_dualpipe(world_size, m)  # and, for DualPipe, P and M even


def main() -> int:
    args = check_flags_against_world(parse_args(), world_rules)
    cfg = PipelineConfig(**mlp_run(args))
    with distributed(args.device) as rt:
        verdict = Verdict(rt)
        print0(
            f"[bold]Lesson 19: DualPipeV[/] - {args.layers} layers on {rt.world_size} rank(s) in a V, "
            f"N = {args.global_batch} in M = {cfg.micro_batches} micro-batches, {args.dtype}, {rt.backend}"
        )
        shown = verdict.figure("grids", grids(verdict, rt.world_size, cfg.micro_batches))
        ours_and_torch(rt, cfg, verdict)
        if args.emulate_ms > 0:
            emulated(rt, cfg, args, shown, verdict)
        verdict.figure("dualpipe", both_directions(rt, cfg, verdict))
        return verdict.finish(args.json)


if __name__ == "__main__":
    run_main(main)
