"""What the schedule exercises (02, 03, 05) share: whether a learner's lists are a schedule, in the
validator's own words (the words their catalogued mistakes are recognised by)."""

from __future__ import annotations

from distlab.pipeline.schedules import check_schedule, split_backward
from distlab.pipeline.simulator import simulate

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
        if split and split_backward(schedule) != {(p, i) for p in range(world) for i in range(microbatches)}:
            return "some backward has no W: every I must be followed, later, by its W"
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
