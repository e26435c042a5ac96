"""Reference vs distributed, tensor by tensor: the readout every self-check and test prints.

Karpathy's `cmp()` idiom, per named tensor: the largest absolute difference, the same relative to the
reference's scale (max |a - r| / max |r|), and whether `torch.allclose(a, r, rtol, atol)` holds.
Tolerances are explicit and depend on the dtype: float64 results must agree to ~1e-10 (only
summation order differs), float32 ones to rtol 1e-5 / atol 1e-6.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

import torch
from rich.table import Table
from torch import nn

TOLERANCES = {  # dtype -> (rtol, atol)
    torch.float64: (1e-10, 1e-12),
    torch.float32: (1e-5, 1e-6),
}
DTYPES = {str(dtype).removeprefix("torch."): dtype for dtype in TOLERANCES}  # by name: what a lesson may offer


def tolerances(dtype: torch.dtype) -> tuple[float, float]:
    """(rtol, atol) for comparing results computed in `dtype`."""
    if dtype not in TOLERANCES:
        raise ValueError(f"no stated tolerance for {dtype}; known: {list(TOLERANCES)}")
    return TOLERANCES[dtype]


@dataclass(frozen=True)
class Comparison:
    """How far `actual` is from the reference: one tensor, or a group of tensors taken as one vector
    (every parameter's gradient, say). max_rel is max |a - r| / max |r| (of a group: its tensors' largest);
    norm_ratio ||a|| / ||r|| (0.25 reads "a quarter of it") and cosine (1: the same direction) say what a
    wrong answer is wrong by; ok: every tensor allclose at the stated tolerances."""

    name: str
    shape: tuple[int, ...]  # a group's: (its elements,)
    max_abs: float
    max_rel: float
    norm_ratio: float
    cosine: float
    ok: bool


def _one(name: str, ref: torch.Tensor, act: torch.Tensor, rtol: float, atol: float) -> Comparison:
    if act.shape != ref.shape:
        return Comparison(name, tuple(ref.shape), *[float("inf")] * 2, float("nan"), float("nan"), False)
    ref64, act64 = ref.detach().double().cpu().flatten(), act.detach().double().cpu().flatten()
    max_abs = (act64 - ref64).abs().max().item() if ref.numel() else 0.0
    scale = ref64.abs().max().item() if ref.numel() else 0.0
    norm = ref64.norm().item()
    return Comparison(
        name,
        tuple(ref.shape),
        max_abs,
        max_abs / scale if scale > 0 else max_abs,
        act64.norm().item() / norm if norm else float("nan"),
        torch.nn.functional.cosine_similarity(act64, ref64, dim=0).item() if ref.numel() else float("nan"),
        torch.allclose(act64, ref64, rtol=rtol, atol=atol),
    )


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
        r_tol, a_tol = tolerances(ref.dtype) if rtol is None or atol is None else (rtol, atol)
        rows.append(_one(name, ref, actual[name], r_tol, a_tol))
    return rows


def compare_whole(
    reference: Mapping[str, torch.Tensor],
    actual: Mapping[str, torch.Tensor],
    scale: float = 1.0,
    name: str = "every tensor",
    rtol: float | None = None,
    atol: float | None = None,
) -> Comparison:
    """`actual` against `scale * reference` (scale = 1/P checks a 1/P claim exactly), every tensor of
    the group as one vector: one `Comparison`, with each tensor allclose for ok."""
    ref = {n: scale * r.detach().cpu() for n, r in reference.items()}
    rows = compare(ref, actual, rtol, atol)
    whole = _one(
        name,
        torch.cat([r.double().flatten() for r in ref.values()]),
        torch.cat([actual[n].detach().double().cpu().flatten() for n in ref]),
        0.0,
        float("inf"),
    )
    return replace(whole, max_rel=max(row.max_rel for row in rows), ok=all_ok(rows))


def against(reference, actual, rtol: float | None = None, atol: float | None = None) -> dict[str, Comparison]:
    """A run against the reference run (`distlab.proof.training.Run`s), each part as one `Comparison`: step 1's
    output (where both have it), step 1's gradients, the parameters after the last step, the optimizer's
    states (where the reference has them) and every step's loss."""
    parts = {}
    if reference.first_output is not None and actual.first_output is not None:
        parts["output"] = compare_whole({"z": reference.first_output}, {"z": actual.first_output}, 1.0, "z", rtol, atol)
    parts["gradients"] = compare_whole(reference.first_grads, actual.first_grads, 1.0, "gradients", rtol, atol)
    parts["parameters"] = compare_whole(reference.params, actual.params, 1.0, "parameters", rtol, atol)
    if reference.states:
        states = [
            {f"{name}.{key}": state[key] for name, state in run.states.items() for key in sorted(state)}
            for run in (reference, actual)
        ]
        parts["optimizer states"] = compare_whole(*states, 1.0, "optimizer states", rtol, atol)
    losses = [{"losses": torch.tensor(run.losses, dtype=torch.float64)} for run in (reference, actual)]
    parts["losses"] = compare_whole(*losses, 1.0, "losses", rtol, atol)
    return parts


def all_ok(rows: Iterable[Comparison]) -> bool:
    return all(row.ok for row in rows)


def comparison_table(rows: Iterable[Comparison], title: str, caption: str = "", expect_match: bool = True) -> Table:
    """A rich table; with `expect_match=False` (lesson 22) a mismatch is what the lesson claims."""
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
