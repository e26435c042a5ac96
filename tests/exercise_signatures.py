"""How the exercises' judge recognises a learner's mistake in what it measured (`exercise_claims.Seen`),
and what it says when it cannot.

Across ranks the judge adds which ranks missed. A `Mistake` is one catalogued error: the claim it breaks,
the signatures that recognise it (`Scaled`, `Proportional`, `Equals`, `Zero`, `Confined`, `OnRanks`,
`Tensors`, `Says`: the vocabulary every exercise shares), the claims it leaves standing (`holds`) and the
others it breaks too (`fails`), and three hints: level 1 names the idea, level 2 the step, level 3 nearly
the line. `diagnose` finds the first catalogued mistake whose signatures all match; when none does it says
what it saw (which claim, which ranks, which tensors, by how much, the ratio it measured, what every
failed structural claim says the answer did) and offers a ratio's reading in the exercise's quantities
only as one possibility, and only where no structural claim contradicts a mere factor.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from exercise_claims import Hints, Seen, show
from exercise_ratios import name_ratio

# ---- the signatures ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Scaled:
    """Every failing rank's got is exactly `text` = factor(P) times the reference's: every tensor of the claim
    whose reference is not zero (some of those right and the others k times is another slip: a factor applied
    to some tensors only)."""

    text: str
    factor: Callable[[int], float]

    def match(self, failing: dict[int, Seen], world: int) -> str | None:
        k = self.factor(world)
        if any(set(s.nonzero) - set(s.tensors) for s in failing.values()):
            return None
        if all(s.ratio is not None and math.isclose(s.ratio, k, rel_tol=1e-6) for s in failing.values()):
            return f"{_where(failing)}: exactly {self.text} = {k:.4g} times the reference"
        return None


@dataclass(frozen=True)
class Proportional:
    """Several tensors missed, all by one and the same factor k, whatever k is (an update not clipped: the
    whole gradient off by its norm over the clipping bound); the tensors in `but` are left out (a
    clamped one)."""

    but: tuple[str, ...] = ()

    def match(self, failing: dict[int, Seen], world: int) -> str | None:
        ks = {None if k is None else round(k, 6) for s in failing.values() for n, k in s.ratios if n not in self.but}
        if None in ks or len(ks) != 1 or any(len(s.ratios) < 2 for s in failing.values()):
            return None
        others = f" (leaving out {', '.join(self.but)})" if self.but else ""
        return f"{_where(failing)}: every tensor that missed{others} is off by one factor, {ks.pop():.6g}"


@dataclass(frozen=True)
class Equals:
    """Every failing rank's got equals the alternative named `name`."""

    name: str

    def match(self, failing: dict[int, Seen], world: int) -> str | None:
        if all(self.name in s.matches for s in failing.values()):
            return f"{_where(failing)}: equal to {self.name}"
        return None


@dataclass(frozen=True)
class Zero:
    """Nothing arrived on any failing rank."""

    def match(self, failing: dict[int, Seen], world: int) -> str | None:
        return f"{_where(failing)}: zero, nothing arrived" if all(s.zero for s in failing.values()) else None


@dataclass(frozen=True)
class Confined:
    """The error lies only inside the region named `name`, on every failing rank."""

    name: str

    def match(self, failing: dict[int, Seen], world: int) -> str | None:
        if all(self.name in s.confined for s in failing.values()):
            return f"the error lies only in {self.name}; everything else is right"
        return None


@dataclass(frozen=True)
class OnRanks:
    """The set of failing ranks is `which(P)`, described as `text` ("every rank but 0")."""

    text: str
    which: Callable[[int], set[int]]

    def match(self, failing: dict[int, Seen], world: int) -> str | None:
        return f"it fails on {self.text}, the others are right" if set(failing) == self.which(world) else None


@dataclass(frozen=True)
class Tensors:
    """Exactly these named tensors miss (on every failing rank); with `but`, every tensor except these."""

    names: tuple[str, ...]
    but: bool = False

    def match(self, failing: dict[int, Seen], world: int) -> str | None:
        for s in failing.values():
            missing = set(s.among) - set(self.names) if self.but else set(self.names)
            if set(s.tensors) != missing:
                return None
        if self.but:
            return f"every tensor but {', '.join(self.names)} missed; {', '.join(self.names)} is right"
        return f"only {', '.join(self.names)} missed; every other tensor is right"


@dataclass(frozen=True)
class Says:
    """The check's own words on every failing rank match `pattern`."""

    pattern: str

    def match(self, failing: dict[int, Seen], world: int) -> str | None:
        notes = {s.note for s in failing.values()}
        return (
            f"the check says: {' / '.join(sorted(notes))}" if all(re.search(self.pattern, n) for n in notes) else None
        )


def _where(failing: dict[int, Seen]) -> str:
    whats = ", ".join(sorted({s.what for s in failing.values()}))
    return f"{whats} on every failing rank" if len(failing) > 1 else f"{whats} on rank {min(failing)}"


def all_but(rank: int) -> OnRanks:
    return OnRanks(f"every rank but {rank}", lambda p: set(range(p)) - {rank})


@dataclass(frozen=True)
class Mistake:
    """A catalogued mistake: the claim it breaks (a regex), the signatures that recognise it there, the
    claims it leaves standing and the other claims it breaks too (regexes: they tell it from its
    look-alikes), and its hints by level."""

    name: str
    claim: str
    seen: tuple
    hints: Hints
    holds: tuple[str, ...] = ()
    fails: tuple[str, ...] = ()


def more_help(level: int) -> str:
    """How to ask for the next level of hints."""
    ask = "a hint" if level == 0 else "more help"
    return f"  ({ask}: --hint-level {level + 1}, or DISTLAB_HINT_LEVEL={level + 1})"


# ---- the diagnosis -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Diagnosis:
    """The failed claim a message is about, on which ranks, the mistake recognised there (or None), what
    the judge saw, and the other claims that failed."""

    claim: str
    failing: dict[int, Seen]
    mistake: Mistake | None
    observations: tuple[str, ...]
    also: tuple[str, ...]
    world: int
    quantities: dict = field(default_factory=dict)
    ran: tuple[str, ...] = ()  # what each rank's answer ran (`exercise_watch.ran_text`), rank by rank
    departs: str = ""  # where the answer first departs from the lesson's function (`exercise_trace`), on a rank

    def message(self, level: int, fallback: Hints = ()) -> str:
        """What a learner reads at hint level `level`: the claim and by how much; from level 1 what the judge
        saw and the hints, the mistake's when one is recognised, else the claim's own, else `fallback` (the
        exercise's own hints: every claim has some)."""
        first = self.failing[min(self.failing)]
        ranks = ", ".join(map(str, sorted(self.failing)))
        lines = [f"claim '{self.claim}' failed on rank(s) {ranks}: {first.what}: {first.amount()}"]
        if self.also:
            lines.append(f"  also failed: {'; '.join(self.also)}")
        # a claim's own hints first, the exercise's carrying on past them: every level adds something
        hints = self.mistake.hints if self.mistake else first.hints + fallback[len(first.hints) :]
        if level >= 1:
            lines.append(f"  the judge saw: {'; '.join(self.observations)}")
            if self.departs:
                lines.append(f"  {self.departs}")
            if any(r != "no collective" for r in self.ran):
                lines.append(f"  what the answer ran: {ran_by_rank(self.ran)}")
            if self.mistake is None and first.hints:
                lines.append("  not one of the catalogued mistakes; the claim's own hints say where to look")
            elif self.mistake is None and hints:
                lines.append("  not one of the catalogued mistakes; the exercise's own hints say where to look")
            elif self.mistake is None:
                lines.append("  no catalogued mistake leaves these traces; what the judge saw is all it can say")
            lines += [f"  hint {k + 1}: {hint}" for k, hint in enumerate(hints[:level])]
        if level == 0 or level < len(hints):  # level 1 adds what the judge saw; past that, only hints remain
            lines.append(more_help(level))
        return "\n".join(lines)


class Findings:
    """Every rank's `Seen`s, in the order the claims were made."""

    def __init__(self, by_rank: list[list[Seen]]):
        self.by_rank = by_rank

    def claims(self) -> list[str]:
        order = []
        for seen in self.by_rank:
            order += [s.claim for s in seen if s.claim not in order]
        return order

    def failing(self, claim: str) -> dict[int, Seen]:
        return {r: s for r, seen in enumerate(self.by_rank) for s in seen if s.claim == claim and not s.ok}

    def failed(self) -> list[str]:
        return [c for c in self.claims() if self.failing(c)]

    def held(self, pattern: str) -> bool:
        """Some claim matching `pattern` was made, and every one of them held on every rank."""
        made = [c for c in self.claims() if re.search(pattern, c)]
        return bool(made) and not any(self.failing(c) for c in made)


def recognise(findings: Findings, mistake: Mistake, world: int) -> Diagnosis | None:
    """The diagnosis when `mistake`'s signatures all match on a failed claim of its, the claims it leaves
    standing held and the others it breaks failed, else None."""
    failed = findings.failed()
    if not all(findings.held(pattern) for pattern in mistake.holds):
        return None
    if not all(any(re.search(pattern, c) for c in failed) for pattern in mistake.fails):
        return None
    for claim in failed:
        if re.search(mistake.claim, claim):
            failing = findings.failing(claim)
            observations = [sig.match(failing, world) for sig in mistake.seen]
            if all(observations):
                also = tuple(c for c in failed if c != claim)
                observations += [
                    f"'{c}' held" for c in findings.claims() if any(re.search(h, c) for h in mistake.holds)
                ]
                observations += [f"'{c}' failed too" for c in also if any(re.search(f, c) for f in mistake.fails)]
                return Diagnosis(claim, failing, mistake, tuple(observations), also, world)
    return None


def ran_by_rank(ran: tuple[str, ...]) -> str:
    """What each rank's answer ran, "every rank: ..." when they ran the same."""
    if len(set(ran)) == 1:
        return f"{'every rank' if len(ran) > 1 else 'rank 0'}: {ran[0]}"
    return "; ".join(f"rank {r}: {text}" for r, text in enumerate(ran))


def diagnose(
    findings: Findings,
    mistakes: tuple[Mistake, ...],
    world: int,
    quantities: dict | None = None,
    numbers: str | None = None,
):
    """The first catalogued mistake the findings show, else the first failed claim with what the judge
    saw there, and what every failed structural claim (a claim not matching `numbers`: bytes, collectives,
    rows run, a schedule's shape) says the answer did. A measured ratio is read in `quantities` (the
    exercise's P, M, C, N, ...) only when the structure agrees with a mere factor (every structural claim held
    or missed by that very factor, every failing rank the same ratio), and then as one reading, never as the
    diagnosis. None when every claim held."""
    failed = findings.failed()
    if not failed:
        return None
    quantities = {"P": world, **(quantities or {})}
    for mistake in mistakes:
        diagnosis = recognise(findings, mistake, world)
        if diagnosis is not None:
            return diagnosis
    structural = [c for c in failed if numbers is not None and not re.search(numbers, c)]
    failing = findings.failing(failed[0])
    # a structural claim that missed by the very factor of the first claim (a message scaled like the gradient
    # it carries) agrees with a mere factor; any other failed structural claim contradicts one
    ks = [s.ratio for s in failing.values()]
    contradict = [c for c in structural if not _same_factor(ks, findings.failing(c).values())]
    facts = describe(failing, world, quantities, read=not contradict)
    for claim in [c for c in structural if c != failed[0]][:2]:  # what the answer did, in the claims' words
        if claim != failed[0]:
            where = findings.failing(claim)
            ranks = ", ".join(map(str, where))
            amount, note = where[min(where)].amount(), failing[min(failing)].note
            if note and amount.endswith(f" ({note})"):  # the first claim's line says it already
                amount = amount[: -len(note) - 3]
            facts.append(f"'{claim}' failed too, on rank(s) {ranks}: {amount}")
    return Diagnosis(failed[0], failing, None, tuple(facts), tuple(failed[1:]), world, quantities)


def _same_factor(ks: list, seen) -> bool:
    """Every ratio in `ks` (the first claim's, rank by rank) and every Seen in `seen` is one and the same factor."""
    if not ks or None in ks:
        return False
    return all(r is not None and math.isclose(r, ks[0], rel_tol=1e-6) for r in ks + [s.ratio for s in seen])


def describe(failing: dict[int, Seen], world: int, quantities: dict | None = None, read: bool = True) -> list[str]:
    """What the judge saw on a failed claim, fact by fact. A ratio shared by every failing rank is given
    as a number; with `read` (the answer's structure agrees with a mere factor) it is also read in the
    exercise's own quantities, as one possibility ("one reading: ..."), never as the cause."""
    seen = list(failing.values())
    held = sorted(set(range(world)) - set(failing))
    facts = [f"ranks that held: {', '.join(map(str, held))}" if held else "it fails on every rank"]
    ratios = {None if s.ratio is None else round(s.ratio, 6) for s in seen}
    if seen[0].got is not None and not isinstance(seen[0].got, (int, float)):
        if all(s.got == seen[0].got for s in seen):
            facts.append(f"measured on {'every failing rank' if len(seen) > 1 else 'it'}: {show(seen[0].got)}")
        else:
            facts.append("measured: " + "; ".join(f"rank {r}: {show(s.got)}" for r, s in failing.items()))
    elif seen[0].got is None and not seen[0].error:  # a yes-or-no claim: its words are on the claim's line
        pass
    elif ratios == {None}:
        facts.append("no single factor relates it to the reference")
    elif len(ratios) == 1 and None not in ratios:
        k = seen[0].ratio
        facts.append(f"got / reference = {k:.6g} on {'every failing rank' if len(seen) > 1 else 'it'}")
        # read only where every rank missed alike: a factor some ranks escaped is no mere factor
        read = read and not held
        reading = name_ratio(k, quantities or {"P": world}, rings="byte" in seen[0].what) if read else None
        if reading:
            facts.append(f"one reading, not a diagnosis: {reading}")
    else:
        facts.append(f"got / reference: {', '.join(f'rank {r}: {_ratio(s)}' for r, s in failing.items())}")
    if any(s.zero for s in seen):
        facts.append(f"zero on rank(s) {', '.join(str(r) for r, s in failing.items() if s.zero)}")
    for s in seen[:1]:
        if s.tensors:
            facts.append(f"tensors that missed: {', '.join(s.tensors)}")
        right = [n for n in s.nonzero if n not in s.tensors]
        if s.tensors and right:  # a factor on some tensors only: where it was applied, and where not
            facts.append(f"tensors that held: {', '.join(right)}")
        if s.offered:
            facts.append(_equals(failing, s.offered))
        if s.regions:
            facts.append(f"the error is confined to none of: {', '.join(s.regions)}")
        facts += _reordered(failing, s.what)
    return facts


def _equals(failing: dict[int, Seen], offered: tuple[str, ...]) -> str:
    """Which offered alternatives the answer equals: "equals: X" only where every failing rank equals X, else
    rank by rank ("on rank 0: equals X; on ranks 1, 2: equals none of ...")."""
    each = {r: tuple(sorted(s.matches)) for r, s in failing.items()}
    said = {m: f"equals: {', '.join(m)}" if m else f"equals none of: {', '.join(offered)}" for m in each.values()}
    if len(said) == 1:
        return next(iter(said.values()))
    ranks = {m: [str(r) for r in each if each[r] == m] for m in said}
    return "; ".join(f"on rank{'s' * (len(ranks[m]) > 1)} {', '.join(ranks[m])}: {said[m]}" for m in said)


def _reordered(failing: dict[int, Seen], what: str) -> list[str]:
    """Where got is the reference's blocks in another order: "Y's 3 blocks along dim 1 hold the reference's
    blocks 0, 2, 1 on rank 0; 2, 1, 0 on rank 1"."""
    each = {r: s.placed for r, s in failing.items() if s.placed}
    if not each:
        return []
    dims = {dim for dim, _ in each.values()}
    along = f" along dim {min(dims)}" if len(dims) == 1 else ""
    said = "; ".join(
        f"{', '.join(map(str, b))} on rank {r}{'' if along else f' (dim {d})'}" for r, (d, b) in each.items()
    )
    count = len(next(iter(each.values()))[1])
    return [f"{what}'s {count} blocks{along} hold the reference's blocks {said}"]


def _ratio(seen: Seen) -> str:
    return "no single factor" if seen.ratio is None else f"{seen.ratio:.6g}"
