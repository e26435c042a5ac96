"""The self-check the pipeline lessons print: each run against the unsplit single-process model.

Each rank holds only its own stage's gradients and parameters, so each compares its share with the
reference's, and the rows are gathered to every rank; the verdict is then the same everywhere. One
summary line per run (the largest error over every tensor of every stage) keeps a 16-layer model's
check readable; lesson 01 prints the per-tensor version.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist
from rich.table import Table

from distlab.compare import Comparison, compare, tolerances
from distlab.reference import ReferenceRun


class Trained(Protocol):
    first_grads: dict[str, torch.Tensor]   # this rank's parameters' gradients after step 1
    params: dict[str, torch.Tensor]        # this rank's parameters after the last step
    losses: list[float]                    # every step's whole-batch loss


def check_runs(runs: dict[str, Trained], ref: ReferenceRun | dict[str, Trained], dtype: torch.dtype,
               title: str = "") -> tuple[Table, bool]:
    """A table with one row per named run, and whether every run matched (identical on all ranks).
    `ref` is the reference for every run, or a dict with one per run name. A collective: call it
    on every rank with the same run names."""
    refs = ref if isinstance(ref, dict) else {name: ref for name in runs}
    mine = {}
    for name, run in runs.items():
        names = run.first_grads.keys()
        mine[name] = (compare({n: refs[name].first_grads[n] for n in names}, run.first_grads),
                      compare({n: refs[name].params[n] for n in names}, run.params))
    gathered: list[dict] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(gathered, mine)

    rtol, atol = tolerances(dtype)
    steps = len(next(iter(refs.values())).losses)
    table = Table(title=title or "every stage against the unsplit model on the whole batch",
                  title_justify="left", caption=f"allclose with rtol {rtol:g}, atol {atol:g}, "
                  "over every tensor of every stage", caption_justify="left")
    for column in ("run", "grads, step 1: max|a-r|", f"params, step {steps}: max|a-r|",
                   "losses: max|a-r|", "allclose"):
        table.add_column(column, justify="left" if column == "run" else "right")
    every_ok = True
    for name, run in runs.items():
        grads = [row for rank in gathered for row in rank[name][0]]
        params = [row for rank in gathered for row in rank[name][1]]
        ref_losses = torch.tensor(refs[name].losses)
        losses_ok = torch.allclose(torch.tensor(run.losses), ref_losses, rtol=rtol, atol=atol)
        loss_err = (torch.tensor(run.losses) - ref_losses).abs().max().item()
        ok = all(r.ok for r in grads + params) and losses_ok
        every_ok &= ok
        table.add_row(name, _worst(grads), _worst(params), f"{loss_err:.2e}",
                      "[green]yes[/]" if ok else "[red]no[/]", style=None if ok else "bold")
    return table, every_ok


def _worst(rows: list[Comparison]) -> str:
    return f"{max(r.max_abs for r in rows):.2e}"
