"""Reference vs distributed, tensor by tensor: the readout every self-check and test prints.

Karpathy's `cmp()` idiom, per named tensor: the largest absolute difference, the same relative to the
reference's scale (max |a - r| / max |r|), and whether `torch.allclose(a, r, rtol, atol)` holds.
Tolerances are explicit and depend on the dtype: float64 results must agree to ~1e-10 (only
summation order differs), float32 ones to rtol 1e-5 / atol 1e-6.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
from rich.table import Table
from torch import nn

TOLERANCES = {  # dtype -> (rtol, atol)
    torch.float64: (1e-10, 1e-12),
    torch.float32: (1e-5, 1e-6),
}


def tolerances(dtype: torch.dtype) -> tuple[float, float]:
    """(rtol, atol) for comparing results computed in `dtype`."""
    if dtype not in TOLERANCES:
        raise ValueError(f"no stated tolerance for {dtype}; known: {list(TOLERANCES)}")
    return TOLERANCES[dtype]


@dataclass(frozen=True)
class Comparison:
    name: str
    shape: tuple[int, ...]
    max_abs: float
    max_rel: float
    ok: bool


def compare(
    reference: Mapping[str, torch.Tensor],
    actual: Mapping[str, torch.Tensor],
    rtol: float | None = None,
    atol: float | None = None,
) -> list[Comparison]:
    """One `Comparison` per name, in the reference's order. Names must match exactly."""
    if set(reference) != set(actual):
        raise KeyError(
            f"names differ: only in reference {sorted(set(reference) - set(actual))}, "
            f"only in actual {sorted(set(actual) - set(reference))}"
        )
    rows = []
    for name, ref in reference.items():
        act = actual[name]
        r_tol, a_tol = tolerances(ref.dtype) if rtol is None or atol is None else (rtol, atol)
        if act.shape != ref.shape:
            rows.append(Comparison(name, tuple(ref.shape), float("inf"), float("inf"), False))
            continue
        ref64, act64 = ref.detach().double().cpu(), act.detach().double().cpu()
        max_abs = (act64 - ref64).abs().max().item() if ref.numel() else 0.0
        scale = ref64.abs().max().item() if ref.numel() else 0.0
        max_rel = max_abs / scale if scale > 0 else max_abs
        ok = torch.allclose(act64, ref64, rtol=r_tol, atol=a_tol)
        rows.append(Comparison(name, tuple(ref.shape), max_abs, max_rel, ok))
    return rows


def all_ok(rows: Iterable[Comparison]) -> bool:
    return all(row.ok for row in rows)


def comparison_table(rows: Iterable[Comparison], title: str, caption: str = "", expect_match: bool = True) -> Table:
    """A rich table; with `expect_match=False` (lesson 11) a mismatch is what the lesson claims."""
    table = Table(title=title, caption=caption, title_justify="left", caption_justify="left")
    for column, justify in (
        ("tensor", "left"),
        ("shape", "left"),
        ("max |a-r|", "right"),
        ("max |a-r| / max |r|", "right"),
        ("allclose", "center"),
    ):
        table.add_column(column, justify=justify)
    for row in rows:
        good = row.ok == expect_match
        mark = "[green]yes[/]" if row.ok else "[red]no[/]" if expect_match else "[yellow]no[/]"
        table.add_row(
            row.name,
            str(list(row.shape)),
            f"{row.max_abs:.2e}",
            f"{row.max_rel:.2e}",
            mark,
            style=None if good else "bold",
        )
    return table


def grads_of(module: nn.Module, prefix: str = "") -> dict[str, torch.Tensor]:
    """Detached copies of every parameter's gradient, by name (zeros where a gradient is None)."""
    return {
        prefix + n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
        for n, p in module.named_parameters()
    }


def params_of(module: nn.Module, prefix: str = "") -> dict[str, torch.Tensor]:
    """Detached copies of every parameter, by name."""
    return {prefix + n: p.detach().clone() for n, p in module.named_parameters()}


@dataclass(frozen=True)
class GradientError:
    """A whole gradient (every parameter as one vector) against the reference: the largest relative
    error of any tensor, the norm ratio ||g|| / ||ref|| (0.25 reads "a quarter of it") and the cosine
    (1 means the same direction), and whether every tensor is allclose."""

    max_rel: float
    norm_ratio: float
    cosine: float
    ok: bool


def gradient_error(
    reference: Mapping[str, torch.Tensor], actual: Mapping[str, torch.Tensor], scale: float = 1.0
) -> GradientError:
    """`actual` against `scale * reference` (scale = 1/P checks a 1/P claim exactly)."""
    ref = {n: scale * r.detach().cpu() for n, r in reference.items()}
    rows = compare(ref, actual)
    flat_ref, flat = (torch.cat([g[n].detach().double().cpu().flatten() for n in ref]) for g in (ref, actual))
    norm = flat_ref.norm().item()
    return GradientError(
        max_rel=max(row.max_rel for row in rows),
        norm_ratio=flat.norm().item() / norm if norm else float("nan"),
        cosine=torch.nn.functional.cosine_similarity(flat, flat_ref, dim=0).item(),
        ok=all_ok(rows),
    )
