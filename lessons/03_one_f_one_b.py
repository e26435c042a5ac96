"""Lesson 03: 1F1B. The same bubble as GPipe, a fraction of its activation memory.

    torchrun --nproc-per-node 4 lessons/03_one_f_one_b.py --micro-batches 7

The idea. GPipe runs every forward before any backward, so each stage holds the saved activations of
all M micro-batches at once. 1F1B (PipeDream-flush: Narayanan et al. 2021, "Memory-Efficient Pipeline-
Parallel DNN Training", arXiv 2006.09503) lets rank r start a backward as soon as one can run: after a
warm-up of min(P - r - 1, M) forwards it alternates one forward and one backward, then drains the
remaining backwards. A micro-batch's activations are freed by its backward, so

    in flight on rank r:  GPipe M,   1F1B min(M, P - r)        (at most P, whatever M is)

and the memory no longer grows with M. The bubble does not change: the first forward still needs
P - 1 ticks to reach the last stage and the last backward P - 1 ticks to come back, so both take
(M + P - 1)(t_F + t_I) and idle (P - 1)/(M + P - 1) of it. 1F1B does not shrink the bubble; what it
buys is the freedom to raise M (which does shrink it) without running out of memory. Lesson 05
shrinks the bubble itself.

The mechanism is the loop `one_f_one_b` below: the whole schedule, as data. The lesson checks it is
the library's (`distlab/model_split/schedules.py: one_f_one_b`, a special case of the interleaved and
zero-bubble schedules of lesson 05), and `distlab/model_split/runner.py: PipelineStep` executes it.

Deadlock. In the steady state rank r sends an activation forward while rank r+1 sends a gradient
back. With blocking send/recv each waits in its send for the other's receive, forever (gloo's send
waits for the receive even for one number). The runner posts matching sends and receives together in
one `batch_isend_irecv`, at the tick of the schedule's own grid where the message travels
(`distlab/model_split/p2p.py: comm_plan`); the tests replay every rank's plan for P <= 6, M <= 13 and
show that blocking transfers in 1F1B's order would deadlock.

Measured. The timeline of 1F1B's last step is recorded on the real CPU (P ranks taking turns on
this machine's cores: mostly scheduling noise) and on an emulated device (`--emulate-ms`,
`distlab/proof/emulate.py`: each layer's pass costs a fixed time in which the rank sleeps, the real math
running inside it), where the warm-up, the alternation and the drain show as the grid draws them.

M < P is allowed here: the first ranks then never reach a steady state and behave like GPipe
(PyTorch's Schedule1F1B refuses M < P; lesson 04). Uneven micro-batches are exact, as in lesson 02.
"""

from __future__ import annotations

from rich.table import Table

from distlab.model_split import schedules
from distlab.model_split.report import check_runs, gathered, show_timelines
from distlab.model_split.runner import PipelineStep
from distlab.model_split.schedules import Action, Schedule, gpipe
from distlab.model_split.simulator import peak_in_flight, render, simulate
from distlab.model_split.training import PipelineConfig, microbatch_sizes, train, unsplit_reference
from distlab.processes.console import print0
from distlab.processes.flags import check_flags_against_world, positive_int
from distlab.processes.runtime import distributed, run_main
from distlab.proof.cli import add_emulate_args, add_mlp_args, lesson_parser, mlp_run, stages_fit_layers
from distlab.proof.verdict import Verdict

# ---- the mechanism: the 1F1B schedule, as data ---------------------------------------------------


def one_f_one_b(num_ranks: int, microbatches: int) -> Schedule:
    """Rank r: warm up with min(P - r - 1, M) forwards, then one forward and one backward in turn
    (the newest forward, the oldest backward), then the remaining backwards."""
    schedule = []
    for r in range(num_ranks):
        warmup = min(num_ranks - r - 1, microbatches)
        order = [Action("F", i, r) for i in range(warmup)]
        for k in range(microbatches - warmup):
            order += [Action("F", warmup + k, r), Action("I", k, r)]
        order += [Action("I", i, r) for i in range(microbatches - warmup, microbatches)]
        schedule.append(order)
    return schedule


# ---- the chapter, part by part -------------------------------------------------------------------


def parse_args(argv: list[str] | None = None):
    parser = add_mlp_args(lesson_parser(__doc__), layers=16, width=128, global_batch=256, steps=3)
    parser.add_argument("--micro-batches", type=positive_int, default=8, help="M, from 1 to N")
    add_emulate_args(parser, ms_per_layer=4.0)
    return parser.parse_args(argv)


def memory_table(runs: dict[str, list], m: int) -> tuple[Table, dict]:
    """Per rank, measured while running: micro-batches in flight and activation bytes held."""
    table = Table(
        title="micro-batches in flight and activation bytes held, per rank (measured while running)",
        title_justify="left",
        caption="saved: peak bytes through saved_tensors_hooks, parameters excluded",
        caption_justify="left",
    )
    for col in ("rank", "GPipe in flight", "1F1B in flight", "min(M, P-r)", "GPipe KiB", "1F1B KiB", "ratio"):
        table.add_column(col, justify="right", overflow="fold")
    for r, (g, o) in enumerate(zip(runs["gpipe"], runs["1f1b"])):
        table.add_row(
            str(r),
            str(g.peak_in_flight),
            str(o.peak_in_flight),
            str(min(m, len(runs["gpipe"]) - r)),
            f"{g.saved_peak_bytes / 2**10:,.1f}",
            f"{o.saved_peak_bytes / 2**10:,.1f}",
            f"{o.saved_peak_bytes / g.saved_peak_bytes:.2f}",
        )
    return table, {
        name: {"in_flight": [x.peak_in_flight for x in ranks], "saved": [x.saved_peak_bytes for x in ranks]}
        for name, ranks in runs.items()
    }


def main() -> int:
    args = check_flags_against_world(parse_args(), stages_fit_layers)
    m = args.micro_batches
    cfg = PipelineConfig(**mlp_run(args), probe=True)
    with distributed(args.device) as rt:
        world, verdict = rt.world_size, Verdict(rt)
        print0(
            f"[bold]Lesson 03: 1F1B[/] - {args.layers} layers on {world} rank(s), N={args.global_batch} in "
            f"M={m} micro-batches of {microbatch_sizes(args.global_batch, m)} rows, {args.dtype}, {rt.backend}"
        )
        orders = {"gpipe": gpipe(world, m), "1f1b": one_f_one_b(world, m)}
        verdict.check(
            "the loop above is the library's 1F1B (schedules.one_f_one_b)",
            orders["1f1b"] == schedules.one_f_one_b(world, m),
        )
        runs = {name: train(rt, cfg, PipelineStep(rt, cfg, order)) for name, order in orders.items()}

        timings = {name: simulate(order) for name, order in orders.items()}
        for name, title in (("1f1b", "1F1B"), ("gpipe", "GPipe")):
            print0(render(timings[name], f"\n{title}, P={world}, M={m} (ticks: F 1, I 2; . idle)"))
        bubbles = verdict.figure("bubbles", {n: t.bubble_fraction() for n, t in timings.items()})
        formula = (world - 1) / (m + world - 1)
        verdict.check(
            "GPipe and 1F1B idle the same share of their grids, (P-1)/(M+P-1)",
            all(abs(b - formula) < 1e-12 for b in bubbles.values()),
            f"GPipe {bubbles['gpipe']:.4f}, 1F1B {bubbles['1f1b']:.4f}, formula {formula:.4f}",
        )

        ref = unsplit_reference(cfg)
        table, matched = check_runs({"GPipe": runs["gpipe"], "1F1B": runs["1f1b"]}, ref, cfg.dtype)
        print0(table)
        verdict.check("GPipe's and 1F1B's gradients, parameters and losses equal the unsplit model's", matched)
        table, measured = memory_table({name: gathered(run) for name, run in runs.items()}, m)
        print0(table)
        verdict.figure("measured", measured)
        closed_form = {"gpipe": [m] * world, "1f1b": [min(m, world - r) for r in range(world)]}
        verdict.check(
            "in flight, measured while running: GPipe M on every rank, 1F1B min(M, P-r) on rank r",
            all(measured[n]["in_flight"] == peak_in_flight(orders[n]) == closed_form[n] for n in orders),
        )
        verdict.check(
            "1F1B holds no more activation bytes than GPipe on any rank",
            all(o <= g for o, g in zip(measured["1f1b"]["saved"], measured["gpipe"]["saved"])),
        )

        # 1F1B's last step measured on the real CPU and on the emulated device (timings: figures only).
        emulated = cfg.replace(emulate_ms=args.emulate_ms, probe=False)
        timelines = show_timelines(rt, emulated, orders["1f1b"], "1F1B", runs["1f1b"], ref, verdict)
        verdict.figure("measured_timelines", timelines)
        return verdict.finish(args.json)


if __name__ == "__main__":
    run_main(main)
