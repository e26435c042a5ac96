"""What the schedule exercises (02, 03, 05, 19) share: whether a learner's lists are a schedule, in the
validator's own words (the words their catalogued mistakes are recognised by), and, when they are, whether
the pipeline runner trains with them exactly the unsplit model (`trains_exact`); where a rank's list leaves the
lesson's order (`departure`) and how its count of each kind differs (`tally`), descriptions beside a claim."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from distlab.model_split.runner import PipelineStep
from distlab.model_split.schedules import Action, check_schedule, split_backward
from distlab.model_split.simulator import simulate
from distlab.model_split.training import train, unsplit_reference
from distlab.proof.compare import all_ok, compare

ONE_AT_A_TIME = "(P-1)/P, lesson 01's: one micro-batch in the pipeline at a time"


def why_invalid(schedule, world: int, microbatches: int, split: bool = False, stages_of=None) -> str:
    """ "" when `schedule` is P lists running F and I (and W, when `split`) once per micro-batch and stage
    without deadlock, each rank only its own stages (`stages_of(r)`: stage r unless given; a V schedule's rank
    r holds stages r and 2P - 1 - r); else why not: "4 lists for 3 ranks", "0F0 appears twice", ..."""
    try:
        if len(schedule) != world:
            return f"{len(schedule)} lists for {world} ranks"
        if check_schedule(schedule) != microbatches:
            return f"not {microbatches} micro-batches"
        ws = split_backward(schedule) if split else set()
        if split and ws != {(p, i) for p in range(world) for i in range(microbatches)}:
            which = "some backward has no W" if ws else "no backward has a W"  # a few left out, or none split
            return f"{which}: every I must be followed, later, by its W"
        simulate(schedule)
    except ValueError as err:
        return str(err)
    own = stages_of or (lambda rank: {rank})
    for rank, actions in enumerate(schedule):  # valid as a graph, but every rank must run its own stages
        elsewhere = sorted({a.stage for a in actions} - own(rank))
        if elsewhere:
            mine = ", ".join(str(stage) for stage in sorted(own(rank)))
            return f"rank {rank} runs stage {elsewhere[0]}: rank {rank}'s list holds stage {mine}'s actions only"
    return ""


def departure(schedule, reference, microbatches: int) -> str:
    """Where a rank's list first leaves the lesson's order (`reference`, the library's own schedule), "" when
    none does: a micro-batch numbering off ("every rank runs micro-batches 1..4, not 0..3"), else the rank,
    the action's place and what it ran there against what the lesson runs, with the micro-batches that rank
    holds at that moment (forwarded, not yet backward): which action, which micro-batch, on which rank. A
    description of what the answer did, never a claim: another valid order is no mistake."""
    lists = isinstance(schedule, (list, tuple)) and all(isinstance(actions, (list, tuple)) for actions in schedule)
    if not lists or not all(isinstance(a, Action) for actions in schedule for a in actions):
        return ""
    runs = [sorted({a.microbatch for a in actions}) for actions in schedule]
    if any(run != list(range(microbatches)) for run in runs):
        off = [r for r, run in enumerate(runs) if run != list(range(microbatches))]
        who = (
            "every rank runs"
            if len(off) == len(runs) and len({tuple(runs[r]) for r in off}) == 1
            else f"rank {off[0]} runs"
        )
        return f"{who} micro-batches {_listed(runs[off[0]])}, not 0..{microbatches - 1}"
    departed = []
    for rank, (actions, lesson) in enumerate(zip(schedule, reference)):
        k = next((k for k, (a, b) in enumerate(zip(actions, lesson)) if a != b), None)
        if k is None and len(actions) != len(lesson):
            k = min(len(actions), len(lesson))
        if k is not None:
            departed.append((rank, k))
    if not departed:
        return ""
    rank, k = departed[0]
    actions, lesson = schedule[rank], reference[rank]
    stage = (actions[k] if k < len(actions) else lesson[min(k, len(lesson) - 1)]).stage  # a V rank holds two
    held = [
        i
        for i in range(microbatches)
        if Action("F", i, stage) in actions[:k] and Action("I", i, stage) not in actions[:k]
    ]
    of = f" of stage {stage}" if len({a.stage for a in actions}) > 1 else ""
    got = _said(actions[k]) if k < len(actions) else "nothing (the list ends)"
    want = _said(lesson[k]) if k < len(lesson) else "nothing (its list ends)"
    before = (
        f", which it ran already at action {actions.index(actions[k])}"
        if k < len(actions) and actions[k] in actions[:k]
        else ""
    )
    rest = [str(r) for r, _ in departed[1:]]
    others = (
        f"; rank{'s' if len(rest) > 1 else ''} {', '.join(rest)} depart{'' if len(rest) > 1 else 's'} too"
        if rest
        else ""
    )
    return (
        f"rank {rank}'s action {k} (from 0) is {got}{before}; the lesson's order runs {want} there, "
        f"rank {rank} holding {f'micro-batches {_listed(held)}' if held else 'no micro-batch'}{of}{others}"
    )


def tally(schedule, reference) -> str:
    """How many actions of each kind every rank runs where that differs from the lesson's order (`reference`),
    "" when none does: "rank 0 runs 2 W, the lesson's order 3 W". A description, never a claim."""
    lists = isinstance(schedule, (list, tuple)) and all(isinstance(actions, (list, tuple)) for actions in schedule)
    if not lists or not all(isinstance(a, Action) for actions in schedule for a in actions):
        return ""
    said = []
    for rank, (actions, lesson) in enumerate(zip(schedule, reference)):
        kinds = sorted({a.kind for a in [*actions, *lesson]}, key="FIW".find)
        counts = [(kind, *(sum(a.kind == kind for a in xs) for xs in (actions, lesson))) for kind in kinds]
        off = [(kind, got, want) for kind, got, want in counts if got != want]
        if off:
            runs, lessons = (", ".join(f"{c[i]} {c[0]}" for c in off) for i in (1, 2))
            said.append(f"rank {rank} runs {runs}, the lesson's order {lessons}")
    more = f"; {len(said) - 2} more ranks' counts differ" if len(said) > 2 else ""
    return "; ".join(said[:2]) + more


def _listed(numbers: list[int]) -> str:
    return ", ".join(map(str, numbers)) or "none"


def _said(action) -> str:
    """'2I1 (stage 2's backward of micro-batch 1)'."""
    kind = {"F": "forward", "I": "backward", "W": "weight gradient"}.get(action.kind, action.kind)
    return f"{action.label} (stage {action.stage}'s {kind} of micro-batch {action.microbatch})"


@dataclass(frozen=True)
class Rules:
    """What makes a learner's lists a schedule here: the claim's words ("F and I once per micro-batch"), its
    hint, whether every backward is split in I and W, and the stages rank r holds (None: stage r)."""

    words: str
    how: str
    split: bool = False
    stages_of: Callable[[int], set[int]] | None = None


def trains_exact(rt, claims, schedule, cfg, rules: Rules, prefix: str = "", reference=None):
    """The check the schedule exercises share: the learner's lists are a schedule (`why_invalid`, its words
    the note), and then, run by the pipeline runner, the gradients and parameters equal the unsplit model's on
    the whole batch (float64). `rules` says what the schedule claim asks for (`Rules`); `prefix` tells apart
    the claims of several M judged in one body ("M=5: "); `reference` the lesson's own order, where the lists
    first leave it added to the validator's words (`departure`). The run, or None when the lists are no
    schedule (training them would hang)."""
    why = why_invalid(schedule, rt.world_size, cfg.micro_batches, split=rules.split, stages_of=rules.stages_of)
    if why and reference is not None:
        where = "; ".join(filter(None, (departure(schedule, reference, cfg.micro_batches), tally(schedule, reference))))
        why = f"{why}; {where}" if where else why
    if not claims.holds(
        f"{prefix}every rank's order is a schedule ({rules.words}, no deadlock)",
        not why,
        what="the schedule",
        note=why,
        hints=(rules.how,),
    ):
        return None
    run, ref = train(rt, cfg, PipelineStep(rt, cfg, schedule)), unsplit_reference(cfg)
    exact = all_ok(compare({n: ref.first_grads[n] for n in run.first_grads}, run.first_grads)) and all_ok(
        compare({n: ref.params[n] for n in run.params}, run.params)
    )
    claims.holds(
        f"{prefix}the gradients and parameters equal the unsplit model's",
        exact,
        what="theta_p",
        hints=("a valid order trains the same model: a micro-batch run twice or skipped changes theta",),
    )
    return run
