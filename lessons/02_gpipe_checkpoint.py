"""Lesson 02: GPipe. Micro-batches fill the pipeline; activation checkpointing trades compute for memory.

    torchrun --nproc-per-node 2 lessons/02_gpipe_checkpoint.py --micro-batches 8 --checkpoint-segments 2

The idea. Lesson 01 sends the whole batch down the stages, so P - 1 of P ranks always wait. GPipe
(Huang et al. 2019, arXiv 1811.06965) cuts the batch of N rows into M micro-batches; stage p forwards
micro-batch i while stage p+1 forwards i-1. Every rank runs all M forwards, then all M backwards, and
steps its optimizer once. With a forward and a backward taking t_F and t_I per micro-batch, the step
takes (M + P - 1)(t_F + t_I), of which each rank computes M(t_F + t_I), so the idle share, the bubble, is

    bubble = (P - 1) / (M + P - 1)        (1 - 1/P for M = 1, lesson 01; towards 0 as M grows).

The lesson counts it in the schedule's own grid, not from the formula.

The exact loss. The step's loss is the mean over all N rows. Micro-batch i (n_i rows) has the mean
loss l_i, and L = sum_i (n_i / N) l_i, so each l_i is scaled by n_i / N before its backward; the
accumulated gradients are exactly the unsplit model's, for micro-batches of any sizes (a batch that
M does not divide is cut by torch.tensor_split: the first N mod M get one row more). Backpropagating
each l_i unscaled would give M times the gradient, which a loss curve hides.

The memory. Every stage holds the saved activations of all M micro-batches until its first
backward. `checkpoint_sequential(layers, K, use_reentrant=False)` keeps only the input of each of
its first K - 1 segments and reruns them in backward: less memory, more forward compute. Its last
segment is never checkpointed (K = 1 would save nothing). For our Linear + Tanh layers autograd
saves one activation per layer (the Tanh output, also the next layer's input) and reruns only what
backward needs, so a checkpointed segment of g layers saves g - 1 activations and reruns g - 1
layers: a one-layer segment saves nothing. Both are measured: the bytes that pass through
`torch.autograd.graph.saved_tensors_hooks`, and the layer forward calls (a hook fires again on
every recomputation). Micro-batches are independent, so any backward order is valid; GPipe here
runs first in, first out, as PyTorch's does.

Measured. The lesson records when each rank computes, twice: on the real CPU, where P ranks share
this machine's cores and take turns on them (so the timeline shows the operating system's scheduling
more than GPipe's), and on an emulated device (`--emulate-ms`, `distlab/proof/emulate.py`): each layer's
forward or backward pass costs a fixed time in which the rank sleeps instead of holding a core, the
real math still running inside it. There the ranks overlap as GPipe says, and the measured idle share
of the step comes out near (P - 1)/(M + P - 1).

The mechanism: the schedule is `gpipe` below (data: each rank's list of actions; the lesson checks
it is the library's, `distlab/model_split/schedules.py: gpipe`), executed by
`distlab/model_split/runner.py: PipelineStep` (its `_forward` scales the loss by n_i / N;
`stage_forward` calls checkpoint_sequential); `distlab/model_split/probe.py: StageProbe`
measures the memory, `distlab/model_split/simulator.py: simulate` draws the grid.
"""

from __future__ import annotations

from rich.table import Table

from distlab.model_split import schedules
from distlab.model_split.partition import stage_bounds
from distlab.model_split.report import check_runs, gathered, show_timelines
from distlab.model_split.runner import PipelineStep
from distlab.model_split.schedules import Action, Schedule
from distlab.model_split.simulator import render, simulate
from distlab.model_split.training import PipelineConfig, microbatch_sizes, train, unsplit_reference
from distlab.processes.console import print0
from distlab.processes.flags import check_flags_against_world, nonnegative_int, positive_int
from distlab.processes.runtime import distributed, run_main
from distlab.proof.cli import add_emulate_args, add_mlp_args, lesson_parser, mlp_run, stages_fit_layers
from distlab.proof.timeline import step_seconds
from distlab.proof.verdict import Verdict

# ---- the mechanism: GPipe's schedule, as data (the runner: distlab.model_split) ---------------------


def gpipe(num_ranks: int, microbatches: int) -> Schedule:
    """Rank r runs stage r: every forward F_0 .. F_{M-1}, then every backward I_0 .. I_{M-1}."""
    return [[Action(kind, i, r) for kind in "FI" for i in range(microbatches)] for r in range(num_ranks)]


# ---- the chapter, part by part -------------------------------------------------------------------


def parse_args(argv: list[str] | None = None):
    parser = add_mlp_args(lesson_parser(__doc__), layers=16, width=128, global_batch=256, steps=3)
    add_emulate_args(parser, ms_per_layer=4.0)
    parser.add_argument("--micro-batches", type=positive_int, default=8, help="M, from 1 to N")
    parser.add_argument(
        "--checkpoint-segments",
        type=nonnegative_int,
        default=2,
        help="K >= 2: checkpoint_sequential segments per stage in the checkpointed run",
    )
    return parser.parse_args(argv)


def memory_table(plain, ckpt, k: int, bounds: list[range]) -> tuple[Table, dict]:
    """Per stage: what it holds for backward and its forward work, with and without checkpointing,
    and which stages can save anything (segments of two or more layers)."""
    table = Table(
        title=f"what each stage holds for backward, and its forward work per step (K={k})",
        title_justify="left",
        caption="saved: peak bytes through saved_tensors_hooks, parameters excluded",
        caption_justify="left",
    )
    for col in ("stage", "layers", "in flight", "saved KiB", "ckpt KiB", "ratio", "layer fwd", "ckpt fwd", "extra"):
        table.add_column(col, justify="right", overflow="fold")
    ratios, can_save = [], []
    for p, (a, b) in enumerate(zip(plain, ckpt)):
        ratios.append(b.saved_peak_bytes / a.saved_peak_bytes)
        can_save.append(len(bounds[p]) // min(k, len(bounds[p])) >= 2)  # a segment of >= 2 layers
        table.add_row(
            str(p),
            str(len(bounds[p])),
            str(a.peak_in_flight),
            f"{a.saved_peak_bytes / 2**10:,.0f}",
            f"{b.saved_peak_bytes / 2**10:,.0f}",
            f"{ratios[-1]:.2f}",
            str(a.layer_forwards),
            str(b.layer_forwards),
            f"{b.layer_forwards / a.layer_forwards - 1:+.0%}",
        )
    return table, {
        "ratios": ratios,
        "can_save": can_save,
        "in_flight": [a.peak_in_flight for a in plain],
        "saved": [(a.saved_peak_bytes, b.saved_peak_bytes) for a, b in zip(plain, ckpt)],
        "forwards": [(a.layer_forwards, b.layer_forwards) for a, b in zip(plain, ckpt)],
    }


def memory_claim(m: dict, k: int) -> tuple[str, bool]:
    """The claim the measurements support, and whether they hold it: segments of two or more layers
    hold less, one-layer segments exactly as much."""
    cut = [r for r, can in zip(m["ratios"], m["can_save"]) if can]
    same = [r for r, can in zip(m["ratios"], m["can_save"]) if not can]
    ok = all(r < 1 for r in cut) and all(r == 1 for r in same)
    if not same:
        span = f"{min(cut):.2f}" + (f"-{max(cut):.2f}" if max(cut) > min(cut) else "")
        return f"K={k} checkpointing holds {span}x the saved activations on every stage", ok
    if not cut:
        return (
            f"K={k} gives one-layer segments, which save nothing: every stage holds 1.00x "
            f"(use K <= layers per stage / 2)"
        ), ok
    return f"stages with K={k} segments of >= 2 layers hold {max(cut):.2f}x or less, one-layer segments 1.00x", ok


def show_bubble(verdict: Verdict, world: int, m: int) -> None:
    """GPipe's grid drawn, its bubble counted against (P-1)/(M+P-1), and the bubble as M grows."""
    timing = simulate(gpipe(world, m))
    print0(render(timing, f"\nGPipe, P={world}, M={m}: one column per tick (F forward 1, I backward 2, . idle)"))
    bubble, formula = verdict.figure("bubble", timing.bubble_fraction()), (world - 1) / (m + world - 1)
    verdict.check(
        "the bubble counted in GPipe's grid is (P-1)/(M+P-1)",
        abs(bubble - formula) < 1e-12,
        f"{bubble:.4f} = {formula:.4f}",
    )
    sizes = sorted({1, world, 2 * world, 4 * world, 8 * world, m})
    curve = verdict.figure("bubble_curve", {mm: simulate(gpipe(world, mm)).bubble_fraction() for mm in sizes})
    print0("bubble vs M, counted in the grids: " + ", ".join(f"M={mm} {b:.3f}" for mm, b in curve.items()))


def show_timing(rt, cfg: PipelineConfig, args, runs: dict, ref, verdict: Verdict) -> None:
    """The measured timeline of GPipe's last step, on the real CPU and on the emulated device, and
    the emulated step's idle share against (P-1)/(M+P-1). (Timings are figures, never checks.)"""
    emulated = cfg.replace(emulate_ms=args.emulate_ms, probe=False)
    measured = show_timelines(
        rt, emulated, gpipe(rt.world_size, args.micro_batches), "GPipe", runs["plain"], ref, verdict
    )
    verdict.figure("measured", measured)
    t_plain, t_ckpt = (step_seconds(runs[k].spans, args.steps) for k in ("plain", "checkpointed"))
    print0(
        f"real CPU step time (median, compute spans): {t_plain * 1e3:.1f} ms plain, {t_ckpt * 1e3:.1f} ms "
        f"checkpointed ({t_ckpt / t_plain - 1:+.0%}; a shared CPU makes this noisy)"
    )


def main() -> int:
    args = check_flags_against_world(parse_args(), stages_fit_layers)
    m, k = args.micro_batches, args.checkpoint_segments
    if k < 2:
        raise ValueError(f"--checkpoint-segments must be >= 2 (this lesson compares K with no checkpointing), got {k}")
    cfg = PipelineConfig(**mlp_run(args), schedule="gpipe", probe=True)
    with distributed(args.device) as rt:
        world, verdict = rt.world_size, Verdict(rt)
        print0(
            f"[bold]Lesson 02: GPipe with activation checkpointing[/] - {args.layers} layers on {world} rank(s), "
            f"N={args.global_batch} in M={m} micro-batches of {microbatch_sizes(args.global_batch, m)} rows"
        )
        # Both runs validate their input on every rank before any message (M, K, P <= layers).
        verdict.check(
            "the schedule above is the library's GPipe (schedules.gpipe)", gpipe(world, m) == schedules.gpipe(world, m)
        )
        plain = train(rt, cfg, PipelineStep(rt, cfg, gpipe(world, m)))
        ckpt = train(
            rt,
            cfg.replace(checkpoint_segments=k),
            PipelineStep(rt, cfg.replace(checkpoint_segments=k), gpipe(world, m)),
        )

        show_bubble(verdict, world, m)

        ref = unsplit_reference(cfg)
        table, matched = check_runs({"GPipe": plain, f"GPipe + checkpointing, K={k}": ckpt}, ref, cfg.dtype)
        print0(table)
        verdict.check(
            "GPipe's gradients, parameters and losses equal the unsplit model's, with and without checkpointing",
            matched,
        )
        memory, measured = memory_table(gathered(plain), gathered(ckpt), k, stage_bounds(args.layers, world))
        print0(memory)
        verdict.check(f"every stage holds all M={m} micro-batches at once", measured["in_flight"] == [m] * world)
        verdict.check(*memory_claim(verdict.figure("memory", measured), k))

        show_timing(rt, cfg, args, {"plain": plain, "checkpointed": ckpt}, ref, verdict)
        return verdict.finish(args.json)


if __name__ == "__main__":
    run_main(main)
