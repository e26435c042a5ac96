"""What lessons 21-25 print: how far a gradient is from the reference, and the tables around it.

For gradients g (a variant's) and r (the single-process reference), over all parameters at once:

- max relative error: max over tensors of max |g - r| / max |r| (`distlab.proof.compare`'s figure),
- norm ratio ||g|| / ||r||: a pure scaling bug shows here as a clean 1/P,
- cosine(g, r): 1 when g points the same way as r, whatever its length,
- allclose: every tensor within the dtype's stated tolerance (float64: rtol 1e-10, atol 1e-12).

Every table fits an 80-column terminal: short column names, their meaning in the caption.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from rich.table import Table

from distlab.contrastive.cost import ring_elements
from distlab.contrastive.training import FINAL_STEPS, TrainRun
from distlab.proof.compare import Comparison
from distlab.proof.memory import MIB

Grads = Mapping[str, torch.Tensor]


def relative_errors(reference: Grads, actual: Grads) -> dict[str, float]:
    """Per parameter: ||g - r|| / ||r|| (what the notebooks plot)."""
    return {n: ((actual[n].double() - r.double()).norm() / r.double().norm()).item() for n, r in reference.items()}


def _table(title: str, caption: str) -> Table:
    return Table(title=title, caption=caption, title_justify="left", caption_justify="left")


def method_table(rows: list[tuple[str, str, Comparison, bool]], title: str, caption: str = "") -> Table:
    """One row per (variant, compared with, its error, whether allclose is what the lesson claims)."""
    table = _table(title, "ratio: ||g|| / ||ref||; cosine: cos(g, ref)" + (f"; {caption}" if caption else ""))
    for column, justify in (
        ("variant", "left"),
        ("vs", "left"),
        ("max rel err", "right"),
        ("ratio", "right"),
        ("cosine", "right"),
        ("allclose", "center"),
    ):
        table.add_column(column, justify=justify)
    for variant, against, err, expect in rows:
        mark = "[green]yes[/]" if err.ok else ("[red]no[/]" if expect else "[yellow]no[/]")
        table.add_row(
            variant,
            against,
            f"{err.max_rel:.2e}",
            f"{err.norm_ratio:.6f}",
            f"{err.cosine:.6f}",
            mark,
            style=None if err.ok == expect else "bold red",
        )
    return table


def work_table(n: int, world: int, d: int) -> Table:
    """Lesson 21: every rank computes the same N x N logits; what that costs in all."""
    table = _table(
        "The redundant work: every rank computes the same N x N logits",
        f"N = {n}, d = {d}, P = {world}; exp: entries the row and column softmaxes exponentiate",
    )
    for column in ("per step", "formula", "one rank", f"all {world} ranks", "needed", "redundant"):
        table.add_column(column, justify="left" if column in ("per step", "formula") else "right")
    for what, formula, once in (
        ("S entries", "N^2", n * n),
        ("multiply-adds", "N^2 d", n * n * d),
        ("exp (softmax)", "2 N^2", 2 * n * n),
    ):
        table.add_row(what, formula, f"{once:,}", f"{world * once:,}", f"{once:,}", f"{(world - 1) * once:,}")
    return table


def seeds_table(runs: Mapping[int, Mapping[str, TrainRun]], held_out: int) -> Table:
    """Lesson 22: per seed, the one-process run (the true gradient) against DDP with the plain gather,
    and the mean and spread (sample standard deviation) over the seeds."""
    table = _table(
        "One process vs the plain gather: same data, weights, optimizer and steps per seed",
        f"final L: the global loss L averaged over the last {FINAL_STEPS} steps; acc: top-1 "
        f"retrieval among {held_out} held-out pairs (chance {1 / held_out:.2%}) after the last "
        "step; diff: plain - one process; mean +- sample standard deviation over the seeds",
    )
    for column in ("seed", "final L", "plain", "diff", "acc", "plain", "diff"):
        table.add_column(column, justify="right")
    cols = {k: [] for k in ("l1", "lp", "dl", "a1", "ap", "da")}
    for seed, pair in runs.items():
        one, plain = pair["one process"], pair["plain"]
        row = (
            one.final_loss,
            plain.final_loss,
            plain.final_loss - one.final_loss,
            one.accuracies[-1],
            plain.accuracies[-1],
            plain.accuracies[-1] - one.accuracies[-1],
        )
        for key, value in zip(cols, row):
            cols[key].append(value)
        table.add_row(
            str(seed),
            *(
                f"{v:+.4f}" if k == "dl" else f"{v:.4f}" if k[0] == "l" else f"{v:+.1%}" if k == "da" else f"{v:.1%}"
                for k, v in zip(cols, row)
            ),
        )
    spread = {k: torch.tensor(v, dtype=torch.float64) for k, v in cols.items()}
    std = {k: v.std().item() if len(v) > 1 else 0.0 for k, v in spread.items()}
    table.add_row(
        "mean", *(f"{spread[k].mean():.4f}" if k[0] in "ld" and k != "da" else f"{spread[k].mean():.1%}" for k in cols)
    )
    table.add_row("+-", *(f"{std[k]:.4f}" if k[0] in "ld" and k != "da" else f"{std[k]:.1%}" for k in cols))
    return table


def detached_at_table(results: Mapping[int, Mapping[str, float]], n: int) -> Table:
    """Lesson 22 --detached-at: the plain gather's training at larger world sizes, each run in one process."""
    table = _table(
        "The plain gather at larger P, each P run in one process (detached-blocks loss)",
        f"final L: L averaged over the last {FINAL_STEPS} steps; P = 1 is the exact run",
    )
    for column in ("P", "C = N/P", "final L", "held-out accuracy"):
        table.add_column(column, justify="right")
    for q in sorted(results):
        table.add_row(str(q), str(n // q), f"{results[q]['final_loss']:.4f}", f"{results[q]['accuracy']:.2%}")
    return table


def cost_table(n: int, world: int, rows: list[tuple[str, Mapping[str, int], Mapping[str, float]]], e: int) -> Table:
    """Lesson 23: what the loss costs one rank; rows of (name, its `global_logits` or `local_logits`,
    its `loss_cost`)."""
    table = _table(
        f"Per rank, the loss forward + backward from the embeddings (N = {n}, P = {world})",
        "global: every rank all N x N logits; local: its C x N rows of S and of S^T; "
        "S: similarity entries its matmuls produce; exp: entries its softmaxes exponentiate; "
        f"largest, peak: tensor storage it allocates (PeakMemory), largest / N^2: the largest "
        f"over an N x N matrix of {e}-byte floats; time: median of 5, slowest rank",
    )
    for column in ("loss", "S", "exp", "largest", "/ N^2", "peak", "time"):
        table.add_column(column, justify="left" if column == "loss" else "right")
    for name, work, cost in rows:
        table.add_row(
            name,
            f"{work['matmul']:,}",
            f"{work['softmax']:,}",
            f"{cost['largest_bytes'] / MIB:.2f} MiB",
            f"{cost['largest_bytes'] / (n * n * e):.3f}",
            f"{cost['peak_bytes'] / MIB:.1f} MiB",
            f"{1e3 * cost['seconds']:.0f} ms",
        )
    return table


def comm_table(world: int, n: int, d: int, e: int, seconds: Mapping[str, float], backend: str) -> Table:
    """Lesson 23: traffic per gathered N x d tensor by the ring formulas, and measured time."""
    note = (
        "; gloo runs a reduce_scatter as an all_reduce of a copy, so no saving shows on CPU"
        if "nccl" not in backend
        else ""
    )
    table = _table(
        f"Communication per gathered N x d tensor (ring; N = {n}, d = {d}, P = {world})",
        f"sent: elements each rank sends (and receives); measured: median of 10, slowest rank, "
        f"{e}-byte floats on {backend}{note}",
    )
    for column in ("collective", "sent", "elements", "MiB", "measured"):
        table.add_column(column, justify="left" if column in ("collective", "sent") else "right")
    formulas = {
        "all_gather (forward)": "(P-1)/P N d",
        "all_reduce (backward)": "2(P-1)/P N d",
        "reduce_scatter (backward)": "(P-1)/P N d",
    }
    for name, elements in ring_elements(world, n, d).items():
        measured = f"{1e3 * seconds[name]:.2f} ms" if name in seconds else "-"
        table.add_row(name, formulas[name], f"{elements:,.0f}", f"{elements * e / MIB:.2f}", measured)
    return table


def memory_account_table(
    largest: int, peak: int, n: int, d: int, cfg, itemsize: int, allocator_peak: int | None = None
) -> Table:
    """Lesson 25's memory account of one streamed step: what it allocated against the sizes it never
    makes (B x N, C x N, N x N); `cfg` is the step's StreamConfig; on a GPU `allocator_peak` is
    `torch.cuda.max_memory_allocated` over the step, shown beside PeakMemory's peak."""
    table = Table(title="Memory account of step 1 (this rank, tensor storage the step allocated)", title_justify="left")
    for column, justify in (("what", "left"), ("bytes", "right"), ("vs N x N", "right")):
        table.add_column(column, justify=justify)
    b, t, full = min(cfg.b, cfg.local), min(cfg.t, n), n * n * itemsize
    for label, nbytes in (
        ("largest temporary the step made", largest),
        ("peak of everything the step held at once", peak),
        *([("the same, as the CUDA allocator saw it", allocator_peak)] if allocator_peak is not None else []),
        (f"gathered Z_x | Z_y (N x 2d = {n} x {2 * d})", n * 2 * d * itemsize),
        (f"one tile, T x T ({t} x {t})", t * t * itemsize),
        (f"B x N ({b} x {n}): never made", b * n * itemsize),
        (f"C x N ({cfg.local} x {n}), lesson 23's logits", cfg.local * n * itemsize),
        (f"N x N ({n} x {n}), lesson 21's logits", full),
    ):
        table.add_row(label, f"{nbytes:,}", f"{nbytes / full:.4f}")
    return table
