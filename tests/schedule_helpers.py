"""What the schedule tests share (tests/test_schedules.py, tests/test_comm_plan.py): every schedule
the library makes, for every (P, M, v) it allows, P <= 6, M <= 13."""

from distlab.model_split.schedules import SCHEDULES, make_schedule

PS, MS = range(1, 7), range(1, 14)


def every_schedule(vs=(2, 3)):
    """(name, P, M, v, schedule) for every schedule and every (P, M, v) it allows, P <= 6, M <= 13."""
    for name, kind in SCHEDULES.items():
        for v in kind.allowed_v or vs:
            for p in PS:
                for m in MS:
                    try:
                        yield name, p, m, v, make_schedule(name, p, m, v)
                    except ValueError as err:
                        assert "rounds of equal size" in str(err), err  # the only refusal


ALL = list(every_schedule())
