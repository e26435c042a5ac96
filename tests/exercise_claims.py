"""What the exercises' judge measures when it compares an answer with the reference: a `Seen` per claim
per rank, recorded through `Claims`.

A `Seen` keeps whether the claim held, what was compared (`what`), by how much it missed (`error`,
relative: max |got - want| / max |want|), and the traces a mistake leaves behind:

- `ratio`   got = k want for one k over the whole tensor (or every tensor of a claim that missed): a
            missing or extra factor of P, of M, of 2 (k = <got, want> / <want, want>, kept when
            got - k want vanishes; `ratios`, each missed tensor's own k);
- `zero`    nothing arrived: got is zero or None (a detached block, a gradient sent as zeros);
- `matches` the alternatives got equals, each what a named misconception computes (this rank's own rows'
            gradient, attention with the diagonal unmasked, the neighbour's block, the order of another
            schedule, ...), computed by the check from the reference's math, never from the answer;
- `confined` the named regions outside which got is right (this rank's shard, the diagonal tiles, ...);
- `tensors` which of a claim's named tensors missed (the logit scale only, every tower tensor);
- `note`    the check's own words (a schedule's validator: "deadlocks", "appears twice");
- `placed`  got is the reference cut in P blocks along one dimension, the blocks in another order (a ring's
            block written where another rank's belongs).

`exercise_signatures` reads these across ranks and recognises the catalogued mistakes in them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

Hints = tuple[str, ...]  # up to three levels: the idea, the step, nearly the line


@dataclass(frozen=True)
class Seen:
    """One claim on one rank: whether it held, and what the comparison showed."""

    claim: str
    ok: bool
    what: str
    error: float = 0.0
    got: Any = None  # numbers only: the measured value and the claimed one
    want: Any = None
    ratio: float | None = None
    zero: bool = False
    matches: tuple[str, ...] = ()
    offered: tuple[str, ...] = ()  # every alternative the check offered
    confined: tuple[str, ...] = ()
    regions: tuple[str, ...] = ()  # every region the check offered
    tensors: tuple[str, ...] = ()  # the named tensors that missed
    among: tuple[str, ...] = ()  # every named tensor of the claim
    nonzero: tuple[str, ...] = ()  # those whose reference is not zero (a factor on them would show)
    ratios: tuple = ()  # (name, k or None) of every tensor that missed
    worst: str = ""  # the named tensor that missed by the most
    note: str = ""
    hints: Hints = ()  # the claim's own hints, for a failure no catalogued mistake explains
    placed: tuple = ()  # (dim, blocks): got's P blocks along dim are the reference's blocks in this order

    def amount(self) -> str:
        """By how much, in one phrase."""
        if self.got is None and not self.error:  # a yes-or-no claim: the check's words say why
            return self.note or "it does not hold"
        if self.got is not None:
            text = f"{show(self.got)}, not {show(self.want)}"
        else:
            text = "nothing arrived (None)" if math.isinf(self.error) and self.zero else f"rel. error {self.error:.2e}"
            text = f"{self.worst}: {text}" if self.worst else text
        return f"{text} ({self.note})" if self.note else text


def show(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, (list, tuple)):
        return " ".join(map(str, value)) if value else "none"
    return str(value)


# ---- measuring: tensors and numbers --------------------------------------------------------------


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = want.abs().max().item() if want.numel() else 0.0
    return (got - want).abs().max().item() / max(scale, 1e-300) if got.numel() else 0.0


def _fits(got: torch.Tensor, want: torch.Tensor, tol: float) -> bool:
    return got is not None and got.shape == want.shape and _rel(got.detach().double(), want.detach().double()) < tol


def tensor_facts(got, want, tol: float, alternatives: dict, regions: dict) -> dict:
    """Every fact of one got/want pair of tensors (see the module docstring)."""
    if got is None:
        return {"error": math.inf, "zero": True}
    if got.shape != want.shape:
        return {"error": math.inf, "note": f"shape {tuple(got.shape)}, not {tuple(want.shape)}"}
    got, want = got.detach().double(), want.detach().double()
    facts = {
        "error": _rel(got, want),
        "zero": bool(got.abs().max() <= tol * want.abs().max()) if got.numel() else False,
    }
    facts["matches"] = tuple(name for name, alt in alternatives.items() if _fits(got, alt, tol))
    facts["confined"] = tuple(
        name for name, inside in regions.items() if _rel(got * ~inside, want * ~inside) < tol < _rel(got, want)
    )
    denominator = (want * want).sum().item()
    if denominator > 0:
        k = (got * want).sum().item() / denominator
        if k != 0 and _rel(got, k * want) < tol:
            facts["ratio"] = k
    if facts["error"] >= tol and torch.distributed.is_initialized():
        facts["placed"] = _placed(got, want, tol, torch.distributed.get_world_size())
    return facts


def _placed(got: torch.Tensor, want: torch.Tensor, tol: float, p: int) -> tuple:
    """(dim, blocks) where got, cut in p equal blocks along dim, holds the reference's blocks in another order
    (blocks[j]: which of want's blocks got's block j equals; want's blocks all distinct), else ()."""
    for dim, size in enumerate(want.shape):
        if size < p or size % p:
            continue
        mine, theirs = got.chunk(p, dim), want.chunk(p, dim)
        same = [[_rel(g, w) < tol for w in theirs] for g in (*mine, *theirs)]
        if any(sum(row) != 1 for row in same[p:]):  # want's blocks not all distinct: no order to read
            continue
        blocks = tuple(row.index(True) if sum(row) == 1 else None for row in same[:p])
        if None not in blocks and blocks != tuple(range(p)):
            return dim, blocks
    return ()


def _common_ratio(got: dict, want: dict, tol: float) -> float | None:
    """The one k with got[n] = k want[n] for every named tensor of `got`, if there is one."""
    pairs = [(g.detach().double(), want[n].detach().double()) for n, g in got.items() if g is not None]
    if len(pairs) < len(got):
        return None
    denominator = sum((w * w).sum().item() for _, w in pairs)
    if denominator == 0:
        return None
    k = sum((g * w).sum().item() for g, w in pairs) / denominator
    return k if k != 0 and all(_rel(g, k * w) < tol for g, w in pairs) else None


# ---- recording: one rank's claims ----------------------------------------------------------------


@dataclass
class Claims:
    """The claims one rank checks, in order, each kept as a `Seen`. Every method returns whether it held on
    every rank, when `agree` is given (`exercise_kit` passes an all-reduce of the flag): a body that stops
    at its first failed claim then stops on every rank at once, so a slip that leaves one rank right and
    the others wrong is a verdict naming those ranks, never a rank left alone in the next collective. Each
    `Seen` keeps this rank's own outcome."""

    seen: list[Seen] = field(default_factory=list)
    agree: Callable[[bool], bool] | None = None

    def _agreed(self, ok: bool) -> bool:
        return self.agree(ok) if self.agree is not None else ok

    def close(self, claim: str, got, want, *, what: str, tol: float = 1e-10, **extra) -> bool:
        """got and want are tensors; `alternatives` (name -> tensor) and `regions` (name -> bool mask)
        are what the judge tells mistakes apart with; `hints` the claim's own, by level."""
        alternatives, regions = extra.pop("alternatives", {}), extra.pop("regions", {})
        facts = tensor_facts(got, want, tol, alternatives, regions)
        ok = facts["error"] < tol
        seen = Seen(claim, ok, what, offered=tuple(alternatives), regions=tuple(regions), **facts, **extra)
        self.seen.append(seen)
        return self._agreed(ok)

    def tensors(self, claim: str, got: dict, want: dict, *, what: str, tol: float = 1e-10, **extra) -> bool:
        """Many named tensors (a model's gradients): `worst` names the one that missed most; `ratio` is the
        one factor shared by every tensor, `zero` that every tensor is zero, `tensors` which missed."""
        alternatives = extra.pop("alternatives", {})
        facts = {name: tensor_facts(got.get(name), w, tol, {}, {}) for name, w in want.items()}
        worst = max(facts, key=lambda name: facts[name]["error"])
        missed = tuple(name for name in want if facts[name]["error"] >= tol)
        matches = tuple(
            alt for alt, values in alternatives.items() if all(_fits(got.get(n), values[n], tol) for n in want)
        )
        self.seen.append(
            Seen(
                claim,
                not missed,
                what,
                error=facts[worst]["error"],
                worst=worst if missed else "",
                ratio=_common_ratio({n: got.get(n) for n in missed}, want, tol) if missed else None,
                zero=all(f.get("zero") for f in facts.values()),
                matches=matches,
                offered=tuple(alternatives),
                tensors=missed,
                among=tuple(want),
                nonzero=tuple(n for n, w in want.items() if w is not None and bool((w != 0).any())),
                ratios=tuple((n, facts[n].get("ratio")) for n in missed),
                **extra,
            )
        )
        return self._agreed(not missed)

    def equal(self, claim: str, got, want, *, what: str, ok: bool | None = None, **extra) -> bool:
        """Numbers, or anything ==: the claim holds when got == want (or `ok` says so, for a bound);
        `alternatives` (name -> value) are the values named mistakes produce."""
        alternatives = extra.pop("alternatives", {})
        held = got == want if ok is None else bool(ok)
        number = isinstance(got, (int, float)) and isinstance(want, (int, float)) and not isinstance(got, bool)
        error = abs(got - want) / max(abs(want), 1e-300) if number else float(not held)
        ratio = got / want if number and want and got and not held else None
        matches = tuple(name for name, value in alternatives.items() if _same(value, got))
        zero = number and got == 0 and want != 0
        self.seen.append(Seen(claim, held, what, error, got, want, ratio, zero, matches, tuple(alternatives), **extra))
        return self._agreed(held)

    def holds(self, claim: str, ok: bool, *, what: str, note: str = "", hints: Hints = ()) -> bool:
        """A claim that is a yes or no (a schedule is valid), with the check's own words when it is not."""
        self.seen.append(Seen(claim, bool(ok), what, note=note, hints=hints))
        return self._agreed(bool(ok))


def _same(a, b) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, (int, float)) and isinstance(b, (int, float)) and math.isclose(a, b, rel_tol=1e-9)
    return a == b
