"""The judge's `Watch` sees every collective an answer can run, and never crashes on one it cannot price.

One spawn of P = 4 ranks runs every kind of collective once under a `Watch`: torch.distributed's (c10d: all-reduce,
its coalesced form, all-gather in its three forms, reduce-scatter, reduce, broadcast, gather, scatter, all-to-all
in its list and single forms, send and receive, blocking, as isend/irecv and as batch_isend_irecv's P2POps (torch's
pipelining's way), the barriers), the functional ones (`_functional_collectives`: all_reduce, all_gather_tensor,
reduce_scatter_tensor, all_to_all_single, their coalesced and autograd forms, broadcast), and
`torch.distributed.nn.functional`'s autograd all-gather and all-reduce, forward and backward. Each test below
checks one kind: what the watch recorded (kind and count) and the bytes it priced, against the bytes worked out
here by hand from the ring formulas and the rank's share: all-reduce 2 (P-1)/P of the tensor, all-gather and
reduce-scatter (P-1)/P of the whole, broadcast and reduce (P-1)/P, all-to-all, gather, scatter and send what leaves
the rank. The all-reduce is also run on a sub-group of 2 ranks: priced over its group, not the world. And an op the
judge does not know is listed and priced at nothing, and the judge turns it into a failed claim naming it."""

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc
import torch.distributed.nn.functional as dist_nn
from exercise_watch import PRICES, Call, Ran, Watch, ran_text, unknown_ops

from distlab.processes.spawn import spawn

P, E = 4, 8  # ranks; bytes per float64 element
ROWS = 8  # elements of the tensor each case moves (a multiple of P)
T = ROWS * E  # its bytes
RING = {"all_reduce": 2 * (P - 1) / P, "gather_like": (P - 1) / P}


def _vector(rank: int) -> torch.Tensor:
    return torch.arange(ROWS, dtype=torch.float64) + 10 * rank


def _leaf(rank: int) -> torch.Tensor:
    return _vector(rank).requires_grad_()


def _cases(rank: int, pairs) -> dict:
    """name -> a function running that collective on this rank (every rank runs every case in order)."""
    world = dist.group.WORLD
    x = _vector(rank)
    parts = list(x.chunk(P))
    empty = [torch.empty_like(x) for _ in range(P)]
    return {
        "all_reduce": lambda: dist.all_reduce(x.clone()),
        "all_reduce on a sub-group": lambda: dist.all_reduce(x.clone(), group=pairs),
        "all_reduce_coalesced": lambda: dist.all_reduce_coalesced([x.clone(), x.clone()]),
        "all_gather": lambda: dist.all_gather(empty, x),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(torch.empty(P * ROWS, dtype=x.dtype), x),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(torch.empty(ROWS // P, dtype=x.dtype), x),
        "reduce": lambda: dist.reduce(x.clone(), dst=0),
        "broadcast": lambda: dist.broadcast(x.clone(), src=0),
        "gather": lambda: dist.gather(x, empty if rank == 0 else None, dst=0),
        "scatter": lambda: dist.scatter(torch.empty_like(x), [x.clone() for _ in range(P)] if rank == 0 else None),
        "all_to_all": lambda: dist.all_to_all([torch.empty_like(p) for p in parts], parts),
        "all_to_all_single": lambda: dist.all_to_all_single(torch.empty_like(x), x),
        "send and recv": lambda: _ring_pass(rank, x),
        "isend and irecv": lambda: [q.wait() for q in _ring_ops(rank, x, dist.isend, dist.irecv)],
        "batch_isend_irecv": lambda: [
            q.wait() for q in dist.batch_isend_irecv(_ring_ops(rank, x, _op(dist.isend), _op(dist.irecv)))
        ],
        "barrier": lambda: dist.barrier(),
        "monitored_barrier": lambda: dist.monitored_barrier(),
        "functional all_reduce": lambda: fc.all_reduce(x, "sum", world).wait(),
        "functional all_gather": lambda: fc.all_gather_tensor(x, 0, world).wait(),
        "functional reduce_scatter": lambda: fc.reduce_scatter_tensor(x, "sum", 0, world).wait(),
        "functional all_to_all_single": lambda: fc.all_to_all_single(x, None, None, world).wait(),
        "functional all_reduce_coalesced": lambda: [t.wait() for t in fc.all_reduce_coalesced([x, x], "sum", world)],
        "functional all_gather_coalesced": lambda: [t.wait() for t in fc.all_gather_into_tensor_coalesced([x], world)],
        "functional broadcast": lambda: fc.broadcast(x, 0, world).wait(),
        "functional all_gather, autograd": lambda: (
            fc.all_gather_tensor_autograd(_leaf(rank), 0, world).sum().backward()
        ),
        "functional reduce_scatter, autograd": lambda: (
            fc.reduce_scatter_tensor_autograd(_leaf(rank), "sum", 0, world).sum().backward()
        ),
        "functional all_to_all, autograd": lambda: (
            fc.all_to_all_single_autograd(_leaf(rank), None, None, world).sum().backward()
        ),
        "nn.functional all_gather, autograd": lambda: torch.stack(dist_nn.all_gather(_leaf(rank))).sum().backward(),
        "nn.functional all_reduce, autograd": lambda: dist_nn.all_reduce(_leaf(rank)).sum().backward(),
    }


def _ring_pass(rank: int, x: torch.Tensor) -> None:
    """Each rank sends x to the next and receives from the one before (even ranks send first)."""
    after, before = (rank + 1) % P, (rank - 1) % P
    if rank % 2 == 0:
        dist.send(x, after)
        dist.recv(torch.empty_like(x), before)
    else:
        dist.recv(torch.empty_like(x), before)
        dist.send(x, after)


def _ring_ops(rank: int, x: torch.Tensor, send, recv) -> list:
    """x to the next rank and a buffer from the one before, posted at once (torch's pipelining's way)."""
    return [send(x, (rank + 1) % P), recv(torch.empty_like(x), (rank - 1) % P)]


def _op(kind):
    """A `P2POp` of `kind` (dist.isend, dist.irecv), for `batch_isend_irecv`."""
    return lambda tensor, peer: dist.P2POp(kind, tensor, peer)


def _expected(rank: int) -> dict:
    """name -> (the kinds recorded, in order, and the bytes this rank sends), worked out by hand."""
    ar, ag = RING["all_reduce"], RING["gather_like"]
    root = rank == 0
    return {
        "all_reduce": (["all_reduce"], ar * T),
        "all_reduce on a sub-group": (["all_reduce"], 2 * (2 - 1) / 2 * T),  # a ring of 2: (P-1)/P = 1/2
        "all_reduce_coalesced": (["all_reduce"], ar * 2 * T),
        "all_gather": (["all_gather"], ag * P * T),
        "all_gather_into_tensor": (["all_gather"], ag * P * T),
        "reduce_scatter_tensor": (["reduce_scatter"], ag * T),
        "reduce": (["reduce"], ag * T),
        "broadcast": (["broadcast"], ag * T),
        "gather": (["gather"], 0 if root else T),  # the root keeps its own; every other rank sends its input
        "scatter": (["scatter"], (P - 1) * T if root else 0),  # the root sends every part but its own
        "all_to_all": (["all_to_all"], (P - 1) / P * T),
        "all_to_all_single": (["all_to_all"], (P - 1) / P * T),
        "send and recv": (["send", "recv"] if rank % 2 == 0 else ["recv", "send"], T),
        "isend and irecv": (["send", "recv"], T),  # the same ops as send and recv, not waited on in them
        "batch_isend_irecv": (["send", "recv"], T),  # gloo: each P2POp is its isend or irecv
        "barrier": (["barrier"], 0),
        "monitored_barrier": (["barrier"], 0),
        "functional all_reduce": (["all_reduce"], ar * T),
        "functional all_gather": (["all_gather"], ag * P * T),
        "functional reduce_scatter": (["reduce_scatter"], ag * T),
        "functional all_to_all_single": (["all_to_all"], (P - 1) / P * T),
        "functional all_reduce_coalesced": (["all_reduce"], ar * 2 * T),
        "functional all_gather_coalesced": (["all_gather"], ag * P * T),
        "functional broadcast": (["broadcast"], ag * T),
        # the autograd forms: the forward's collective, then its adjoint in backward
        "functional all_gather, autograd": (["all_gather", "reduce_scatter"], 2 * ag * P * T),
        "functional reduce_scatter, autograd": (["reduce_scatter", "all_gather"], 2 * ag * T),
        "functional all_to_all, autograd": (["all_to_all", "all_to_all"], 2 * (P - 1) / P * T),
        # gloo has no reduce-scatter: torch.distributed.nn's all-gather backward runs P scatters, one per
        # root, each root sending the P - 1 gradient blocks of the others: (P-1)/P of the whole, as a ring
        "nn.functional all_gather, autograd": (["all_gather"] + ["scatter"] * P, 2 * ag * P * T),
        "nn.functional all_reduce, autograd": (["all_reduce", "all_reduce"], 2 * ar * T),
    }


def _rank(rt) -> dict:
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])][rt.rank // 2]
    seen = {}
    for name, run in _cases(rt.rank, pairs).items():
        with Watch() as watch, Ran() as ran:  # the same calls, priced and put in words
            run()
        seen[name] = ([c.kind for c in watch.collectives], watch.sent(P), watch.unknown, ran.calls)
        dist.barrier()
    return seen


@pytest.fixture(scope="module")
def every_rank() -> list[dict]:
    return spawn(_rank, P, timeout_s=60, limit_s=240)


@pytest.mark.parametrize("name", list(_expected(0)))
def test_watch_records_and_prices(name, every_rank):
    for rank, seen in enumerate(every_rank):
        kinds, sent, unknown, _ = seen[name]
        want_kinds, want_sent = _expected(rank)[name]
        assert unknown == [], f"rank {rank}: {name}: the watch could not price {unknown}"
        assert kinds == want_kinds, f"rank {rank}: {name}: recorded {kinds}, want {want_kinds}"
        assert sent == pytest.approx(want_sent, rel=1e-12), f"rank {rank}: {name}: priced {sent}, want {want_sent}"


def test_every_kind_the_judge_prices_is_run(every_rank):
    kinds = {kind for seen in every_rank for kinds, *_ in seen.values() for kind in kinds}
    assert kinds == set(PRICES), f"run {sorted(kinds)}, priced {sorted(PRICES)}"


def test_what_an_answer_ran_is_said_with_its_root_peer_and_group(every_rank):
    """`Ran` words each call in global ranks: to or from whom, on which group (the judge's "what the answer ran")."""
    for rank, seen in enumerate(every_rank):
        pair = "0-1" if rank < 2 else "2-3"
        assert seen["reduce"][3] == ["reduce to rank 0 on ranks 0-3"], seen["reduce"][3]
        assert seen["scatter"][3] == ["scatter from rank 0 on ranks 0-3"], seen["scatter"][3]
        assert seen["all_reduce on a sub-group"][3] == [f"all_reduce on ranks {pair}"]
        sent, got = f"send to rank {(rank + 1) % P} on ranks 0-3", f"recv from rank {(rank - 1) % P} on ranks 0-3"
        assert sorted(seen["send and recv"][3]) == sorted([sent, got]), seen["send and recv"][3]
        assert seen["isend and irecv"][3] == seen["batch_isend_irecv"][3] == [sent, got], seen["batch_isend_irecv"][3]
    assert ran_text(["reduce to rank 0 on ranks 0-3"] * 4 + ["barrier on ranks 0-3"]) == (
        "reduce to rank 0 on ranks 0-3 x4, barrier on ranks 0-3"
    )
    assert ran_text([]) == "no collective"


def test_an_unknown_op_is_listed_and_priced_at_nothing_never_a_crash():
    watch, before = Watch(), len(unknown_ops())
    watch._collective("c10d", "made_up_", (), {})
    watch.collectives.append(Call("all_reduce", 300, 3))
    assert watch.unknown == ["c10d.made_up_"] and unknown_ops(before) == ["c10d.made_up_"]
    assert watch.sent(3) == pytest.approx(2 * 2 / 3 * 300)  # the unknown op adds nothing, and raises nothing
    assert watch.calls()["unknown c10d.made_up_"] == 1


def test_the_judge_fails_a_claim_naming_an_unknown_op():
    """`exercise_kit._rank` puts a failed claim first that names what the judge could not price."""
    from exercise_kit import Answer
    from exercise_ranks import UNKNOWN_CLAIM, _rank
    from exercise_signatures import Findings, diagnose

    def body(rt, fn, claims):
        Watch()._collective("_c10d_functional", "shiny_new_collective", (), {})
        claims.equal("numbers", 1, 1, what="n")

    class _Rt:
        rank, world_size = 0, 1

    answer = Answer(__import__("pathlib").Path(__file__), "_leaf")
    (report,) = _rank(_Rt(), body, [answer], ())
    assert report["seen"][0].claim == UNKNOWN_CLAIM and not report["seen"][0].ok
    text = diagnose(Findings([report["seen"]]), (), 1).message(1)
    assert "_c10d_functional.shiny_new_collective" in text and "hint 1" in text, text


def test_sent_prices_old_two_field_records():
    """A record written as (kind, bytes), as the judge's tests build them, is priced over `world`."""
    watch = Watch()
    watch.collectives = [("all_reduce", 300), Call("all_reduce", 300, 2)]
    assert watch.sent(3) == pytest.approx(2 * 2 / 3 * 300 + 2 * 1 / 2 * 300)
