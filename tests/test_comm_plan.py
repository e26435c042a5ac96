"""The pipeline runner's communication plan, replayed for every rank at once without processes: for every
schedule it never deadlocks and matches every message; and the replay can fail (blocking send/recv in
1F1B's order deadlocks)."""

from schedule_helpers import ALL

from distlab.model_split.p2p import Transfer, comm_plan, produces
from distlab.model_split.schedules import gpipe, one_f_one_b
from distlab.model_split.simulator import simulate


def replay(plans: list[list[list[Transfer]]]) -> bool:
    """Advance every rank through its batches; a batch completes once every transfer in it has its
    partner posted (a rendezvous, as gloo's send and NCCL's do). True if every rank finishes.
    Also checks that the k-th message a rank sends another is the k-th that one receives."""
    numbered = []
    for rank, plan in enumerate(plans):
        counters: dict = {}
        rows = []
        for batch in plan:
            row = []
            for t in batch:
                pair = (rank, t.peer) if t.op == "send" else (t.peer, rank)
                counters[pair, t.op] = counters.get((pair, t.op), 0) + 1
                row.append((pair, counters[pair, t.op], t))
            rows.append(row)
        numbered.append(rows)
    sends = {(k, n): t for rows in numbered for row in rows for k, n, t in row if t.op == "send"}
    recvs = {(k, n): t for rows in numbered for row in rows for k, n, t in row if t.op == "recv"}
    assert sends.keys() == recvs.keys()
    assert all(sends[k].message == recvs[k].message for k in sends)

    position, posted, progress = [0] * len(plans), set(), True
    partner = {"send": "recv", "recv": "send"}
    while progress:
        progress = False
        for rank, rows in enumerate(numbered):
            if position[rank] == len(rows):
                continue
            before = len(posted)
            posted.update((k, n, t.op) for k, n, t in rows[position[rank]])
            progress |= len(posted) > before
            if all((k, n, partner[t.op]) in posted for k, n, t in rows[position[rank]]):
                position[rank] += 1
                progress = True
    return all(position[r] == len(numbered[r]) for r in range(len(plans)))


def blocking_plan(schedule, rank: int) -> list[list[Transfer]]:
    """What plain blocking send/recv would do: before each action receive its input, after it send
    its output, one transfer at a time (lesson 01's chain, applied to a schedule)."""
    where = {p: r for r, order in enumerate(schedule) for a in order for p in [a.stage]}
    stages, plan = len(where), []
    for a in schedule[rank]:
        source = a.stage - 1 if a.kind == "F" else a.stage + 1
        if a.kind != "W" and 0 <= source < stages and where[source] != rank:
            plan.append(
                [Transfer("recv", where[source], "activation" if a.kind == "F" else "gradient", a.microbatch, a.stage)]
            )
        made = produces(a, stages)
        if made and where[made[1]] != rank:
            plan.append([Transfer("send", where[made[1]], made[0], a.microbatch, made[1])])
    return plan


def test_the_runners_plan_never_deadlocks_and_matches_every_message():
    for name, p, m, v, schedule in ALL:
        timing = simulate(schedule)
        assert replay([comm_plan(schedule, r, timing) for r in range(p)]), (name, p, m, v)


def test_the_replay_catches_the_deadlock_of_blocking_send_recv_in_1f1b():
    """Guard against a replay that cannot fail: blocking send/recv in 1F1B's order deadlocks, in
    GPipe's it does not (nobody sends both ways at once)."""
    assert not replay([blocking_plan(one_f_one_b(2, 3), r) for r in range(2)])
    assert replay([blocking_plan(gpipe(2, 3), r) for r in range(2)])
    assert replay([comm_plan(one_f_one_b(2, 3), r) for r in range(2)])
