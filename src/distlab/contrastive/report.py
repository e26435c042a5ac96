"""How far a gradient is from the reference, in a few numbers a lesson can print (and a notebook plot).

For gradients g (the method's) and r (the single-process reference), over all parameters at once:

- max relative error: max over tensors of max |g - r| / max |r| (`distlab.compare`'s figure),
- norm ratio ||g|| / ||r||: a pure scaling bug shows here as a clean 1/P,
- cosine(g, r): 1 when g points the same way as r, whatever its length,
- allclose: every tensor within the dtype's stated tolerance (float64: rtol 1e-10, atol 1e-12).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch
from rich.table import Table

from distlab.compare import all_ok, compare

Grads = Mapping[str, torch.Tensor]


@dataclass(frozen=True)
class GradientError:
    max_rel: float
    norm_ratio: float
    cosine: float
    ok: bool


def _flat(grads: Grads, names) -> torch.Tensor:
    return torch.cat([grads[n].detach().double().cpu().flatten() for n in names])


def gradient_error(reference: Grads, actual: Grads, scale: float = 1.0) -> GradientError:
    """Compare `actual` with `scale * reference` (scale = 1/P checks a 1/P claim exactly)."""
    ref = {n: scale * r for n, r in reference.items()}
    rows = compare(ref, actual)
    r, g = _flat(ref, ref), _flat(actual, ref)
    return GradientError(
        max_rel=max(row.max_rel for row in rows),
        norm_ratio=(g.norm() / r.norm()).item(),
        cosine=torch.nn.functional.cosine_similarity(g, r, dim=0).item(),
        ok=all_ok(rows),
    )


def relative_errors(reference: Grads, actual: Grads) -> dict[str, float]:
    """Per parameter: ||g - r|| / ||r|| (what the notebooks plot)."""
    return {n: ((actual[n].double() - r.double()).norm() / r.double().norm()).item()
            for n, r in reference.items()}


def method_table(rows: list[tuple[str, str, GradientError, bool]], title: str, caption: str = "") -> Table:
    """One row per method: (method, against what, its error, whether allclose is what we claim)."""
    table = Table(title=title, caption=caption, title_justify="left", caption_justify="left")
    for column, justify in (("method", "left"), ("compared with", "left"), ("max rel err", "right"),
                            ("||g|| / ||ref||", "right"), ("cosine", "right"), ("allclose", "center")):
        table.add_column(column, justify=justify)
    for method, against, err, expect in rows:
        mark = "[green]yes[/]" if err.ok else ("[red]no[/]" if expect else "[yellow]no[/]")
        table.add_row(method, against, f"{err.max_rel:.2e}", f"{err.norm_ratio:.6f}", f"{err.cosine:.6f}",
                      mark, style=None if err.ok == expect else "bold red")
    return table
