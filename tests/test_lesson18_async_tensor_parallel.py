"""Lesson 18: the all-gather + matmul ring equals the whole X times W_r^T computed in one process, bit for bit, and
the travelling partial sum equals one process's sum of every rank's term to 1e-12 (float64), at P = 1, 2, 3;
each sends (P-1)/P of the whole tensor, counted as the messages leave the rank; the async MLP's output and every
gradient equal the unsplit MLP's; each check rejects a wrong twin (blocks put where they arrive, the sum sent the
wrong way round, a ring that waits before it multiplies hides no message); seq or d_ff that P does not divide is
one line naming the flag on every rank; the lesson passes at P = 4 at 80 columns."""

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import assert_lesson_passes_at_80_columns, assert_same_error_on_every_rank, load_lesson

from distlab.comm.watch import CollectiveWatch
from distlab.processes.spawn import spawn

ARGS = SimpleNamespace(global_batch=4, seq_len=12, dim=6, ffn_width=12, seed=3)  # 48 rows: MKL's kernel for any block
SEQ = 1


def _whole():
    """X (N, seq, d), a column weight W (d_ff, d) and bias, and every rank's term H_q (N, seq, d_ff/P) with
    its row weight B_q (d, d_ff/P), drawn alike on every rank: the one-process reference's inputs."""
    gen = torch.Generator().manual_seed(18)
    x = torch.randn(ARGS.global_batch, ARGS.seq_len, ARGS.dim, generator=gen, dtype=torch.float64)
    w, b = (
        torch.randn(ARGS.ffn_width, ARGS.dim, generator=gen, dtype=torch.float64),
        torch.randn(ARGS.ffn_width, generator=gen),
    )
    h = torch.randn(ARGS.global_batch, ARGS.seq_len, ARGS.ffn_width, generator=gen, dtype=torch.float64)
    v = torch.randn(ARGS.dim, ARGS.ffn_width, generator=gen, dtype=torch.float64)
    return x, w, b.double(), h, v


def _in_arrival_order(lesson):
    """The wrong twin: each block's rows put at the step they were computed in, not at their source rank."""

    @torch.no_grad()
    def ring(x, weight, bias, group=None, clock=None):
        gathered, y = lesson.all_gather_matmul(x, weight, bias, group, clock)
        r, p = dist.get_rank(group), dist.get_world_size(group)
        order = [(r - k) % p for k in range(p)]  # the source of the block computed in step k
        return gathered, torch.cat([y.chunk(p, dim=SEQ)[s] for s in order], dim=SEQ)

    return ring


def _waits_first(lesson):
    """The wrong twin of the overlap: each block received before the next is multiplied (the same numbers)."""

    def ring(x, weight, bias, group=None, clock=None):
        r, p = dist.get_rank(group), dist.get_world_size(group)
        held, blocks = x.contiguous(), [None] * p
        for k in range(p):
            with clock.compute(str((r - k) % p)):
                blocks[(r - k) % p] = F.linear(held, weight, bias)
            if k < p - 1:
                (held,) = clock.post("w", [(held, (r + 1) % p)], [(torch.empty_like(held), (r - 1) % p)], group).wait()
        return None, torch.cat(blocks, dim=SEQ)

    return ring


def _ranks(rt):
    lesson = load_lesson("async_tensor_parallel")
    p, r = rt.world_size, rt.rank
    x, w, b, h, v = _whole()
    mine, w_r, b_r = x.chunk(p, dim=SEQ)[r], w.chunk(p)[r], b.chunk(p)[r]
    h_r, v_r = h.chunk(p, dim=2)[r], v.chunk(p, dim=1)[r]
    with CollectiveWatch({"tp": dist.group.WORLD}) as watch:
        gathered, y = lesson.all_gather_matmul(mine, w_r, b_r)
        watch.phase = "sum"
        z = lesson.matmul_reduce_scatter(h_r, v_r)
    ring, waits = lesson.Clock(), lesson.Clock()
    lesson.all_gather_matmul(mine, w_r, b_r, None, ring)
    _waits_first(lesson)(mine, w_r, b_r, None, waits)
    _, scrambled = _in_arrival_order(lesson)(mine, w_r, b_r)
    ledger = watch.ledgers["tp"]
    mlp = lesson.mlp_run(rt, ARGS, lesson.AsyncMLP)[:2]
    return {
        "ag": (gathered, y, scrambled),
        "rs": z,
        "sent": (ledger.sent_in(""), ledger.sent_in("sum")),
        "hidden": (lesson.hidden(ring), lesson.hidden(waits)),
        "mlp": mlp,
    }


@pytest.fixture(scope="module")
def runs():
    return {p: spawn(_ranks, p) for p in (1, 2, 3)}


@pytest.mark.parametrize("world", [1, 2, 3])
def test_the_ring_equals_the_whole_matmul_bit_for_bit_and_arrival_order_does_not(runs, world):
    x, w, b, _, _ = _whole()
    scrambled_right = []
    for r, rank in enumerate(runs[world]):
        gathered, y, scrambled = rank["ag"]
        want = F.linear(x, w.chunk(world)[r], b.chunk(world)[r])  # one process: the whole X, rank r's columns
        assert torch.equal(gathered, x) and torch.equal(y, want)
        scrambled_right.append(torch.equal(scrambled, want))
    assert all(scrambled_right) == (world == 1)  # from P = 2 some rank's rows come out in the wrong order


@pytest.mark.parametrize("world", [1, 2, 3])
def test_the_travelling_sum_equals_one_process_sum_and_a_wrong_rows_answer_does_not(runs, world):
    _, _, _, h, v = _whole()
    whole = h @ v.t()  # every rank's term summed at once, in one process
    for r, rank in enumerate(runs[world]):
        want = whole.chunk(world, dim=SEQ)[r]
        assert (rank["rs"] - want).abs().max() < 1e-12
        if world > 1:  # the neighbour's rows are not this rank's: the check tells them apart
            assert (rank["rs"] - whole.chunk(world, dim=SEQ)[(r + 1) % world]).abs().max() > 1e-3


@pytest.mark.parametrize("world", [1, 2, 3])
def test_each_ring_sends_p_minus_1_over_p_of_the_whole(runs, world):
    x_bytes = ARGS.global_batch * ARGS.seq_len * ARGS.dim * 8
    for rank in runs[world]:
        assert rank["sent"] == ((world - 1) * x_bytes // world,) * 2


@pytest.mark.parametrize("world", [2, 3])
def test_every_message_runs_under_a_matmul_and_a_ring_that_waits_first_hides_none(runs, world):
    for rank in runs[world]:
        assert rank["hidden"] == (world - 1, 0)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_the_async_mlp_equals_the_unsplit_mlp(runs, world):
    lesson = load_lesson("async_tensor_parallel")
    mlp, x, dz = lesson.problem(ARGS)
    whole = x.clone().requires_grad_()
    out = mlp(whole)
    out.backward(dz)
    for r, (got, grads) in enumerate(rank["mlp"] for rank in runs[world]):
        assert torch.allclose(got, out.detach().chunk(world, dim=SEQ)[r], rtol=1e-10, atol=1e-12)
        assert torch.allclose(grads["input"], whole.grad.chunk(world, dim=SEQ)[r], rtol=1e-10, atol=1e-12)
        assert torch.allclose(grads["fc1.weight"], mlp[0].weight.grad.chunk(world)[r], rtol=1e-10, atol=1e-12)
        assert torch.allclose(grads["fc2.weight"], mlp[2].weight.grad.chunk(world, dim=1)[r], rtol=1e-10, atol=1e-12)
        assert torch.allclose(grads["fc2.bias"], mlp[2].bias.grad, rtol=1e-10, atol=1e-12)


def _check(rt, seq_len, ffn_width):
    lesson = load_lesson("async_tensor_parallel")
    lesson.world_rules(SimpleNamespace(seq_len=seq_len, ffn_width=ffn_width), rt.world_size)


def test_a_sequence_or_width_p_does_not_divide_is_refused_on_every_rank():
    message = assert_same_error_on_every_rank(_check, 3, 8, 12, match="--seq-len")
    assert "seq = 8" in message and "P = 3" in message and "\n" not in message
    with pytest.raises(ValueError, match="--ffn-width: d_ff = 8"):
        load_lesson("async_tensor_parallel").world_rules(SimpleNamespace(seq_len=12, ffn_width=8), 3)


def test_the_lesson_passes():
    out = assert_lesson_passes_at_80_columns("18_async_tensor_parallel.py", 4, "--repeats", "1")
    assert "3 of 3" in out and "speed-up" in out
