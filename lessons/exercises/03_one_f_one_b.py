"""Exercise 03: the 1F1B schedule, as data (read lessons/03_one_f_one_b.py first; check your answer with
`pytest --exercises -k 03`).

A schedule is, per rank r, the ordered list of actions that rank runs on its one stage (stage r):
`Action("F", i, r)` the forward of micro-batch i, `Action("I", i, r)` its backward (the input's gradient,
which rank r - 1 waits for, and here also the weights' gradient). Write `one_f_one_b`: rank r

    warms up with w_r = min(P - r - 1, M) forwards (F0 .. F_{w_r - 1}),
    then alternates one forward and one backward, the newest forward and the oldest backward
        (F_{w_r}, I0, F_{w_r + 1}, I1, ...) until every forward has run,
    then runs the remaining backwards in order.

A micro-batch's activations are freed by its backward, so rank r never holds more than min(M, P - r)
of them, where GPipe (every forward, then every backward) holds all M. The runner executes your lists on
real ranks; the judge checks the gradients against the unsplit model and counts what each rank held.

Hints:
- `from distlab.pipeline.schedules import Action`; `Action(kind, microbatch, stage)`;
- rank r = P - 1 warms up with no forward at all: F0, I0, F1, I1, ...;
- with M < P the first ranks never reach the alternation: all their forwards, then all their backwards.
"""

from __future__ import annotations

from distlab.pipeline.schedules import Action, Schedule  # noqa: F401  (you will need them)


def one_f_one_b(num_ranks: int, microbatches: int) -> Schedule:
    """Rank r: warm up with min(P - r - 1, M) forwards, then one forward and one backward in turn
    (the newest forward, the oldest backward), then the remaining backwards."""
    raise NotImplementedError(
        "not written yet: one_f_one_b(num_ranks, microbatches), each rank's list of F and I actions in 1F1B's order"
    )
