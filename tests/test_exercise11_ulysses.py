"""Exercise 11: Ulysses attention, judged on 3 ranks against torch's scaled_dot_product_attention on the
whole sequence in one process, then at P = 4 as two groups of two with different sequences, where an all-to-all
that ignores the group it is given mixes the two groups' sequences.

Each rank takes its contiguous block of q, k, v (h x seq/P x d_h), calls the answer causal and not, and
back-propagates its block of an upstream gradient. The lesson's claims: this rank's out and the gradients of
its q, k, v equal one process's (float64, rtol 1e-10); and its collectives send 4 (P-1)/P blocks forward
and as many backward (the judge prices every collective it sees: an all-to-all by the bytes that leave the
rank, the others by the ring formulas), never the whole sequence."""

from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from exercise_kit import Exercise, solution, swapped
from exercise_signatures import Equals, Mistake, Zero
from exercise_watch import Watch

from distlab.comm.ledger import Ledger
from distlab.contrastive.gather import gather_with_grad
from distlab.layer_split.context_parallel.split import shard

LESSON, NAME = "11_ulysses", "ulysses_attention"
P, PAIRS, HEADS, SEQ, HEAD_DIM = 3, 4, 12, 12, 4  # the whole world of 3; at 4 ranks, two groups of 2
OWN = "attention over this rank's own positions alone"
ARRIVAL = "attention with the arrived rows read in arrival order (heads and positions mixed)"
NOT_CAUSAL = "attention without the causal mask"
BOTH_SIDES = "attention with the rows read in arrival order on the way in and written back as they lie"
WORLD = "attention over both groups' sequences end to end: the all-to-alls on the whole world, not the group"


def _group(rt) -> tuple:
    """(the group the answer runs on, its index): the world (None) at P = 3, and at P = 4 this rank's pair
    {0, 1} or {2, 3} (every rank builds both: new_group is collective)."""
    if rt.world_size != PAIRS:
        return None, 0
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    return pairs[rt.rank // 2], rt.rank // 2


def _sequences(index: int) -> list:
    """Group `index`'s q, k, v and upstream gradient (h, seq, d_h each): different in every group."""
    gen = torch.Generator().manual_seed(6 + 100 * index)
    return [torch.randn(HEADS, SEQ, HEAD_DIM, generator=gen, dtype=torch.float64) for _ in range(4)]


def _arrival_order(full: list, rank: int, causal: bool, P: int) -> torch.Tensor:
    """This rank's out when every rank reads what arrives as (h/P, seq, d_h) as it lies, rank by rank."""
    mine, local = HEADS // P, SEQ // P
    outs = []
    for g in range(P):  # what rank g computes: its head group, the rows of every rank, unreordered
        lying = [torch.stack([shard(t, s, P, "contiguous")[g * mine : (g + 1) * mine] for s in range(P)]) for t in full]
        outs.append(F.scaled_dot_product_attention(*(t.reshape(mine, SEQ, HEAD_DIM) for t in lying), is_causal=causal))
    return torch.cat([y[:, rank * local : (rank + 1) * local] for y in outs])


def _arrival_both_ways(full: list, rank: int, causal: bool, P: int) -> torch.Tensor:
    """This rank's out when the pieces are read in arrival order on the way in (as `_arrival_order`) and the
    result cut into rows as it lies on the way back (no transpose either side): heads and positions mixed
    in the attention, unmixed again in the output's places."""
    mine, local = HEADS // P, SEQ // P
    back = []
    for g in range(P):
        lying = [torch.stack([shard(t, s, P, "contiguous")[g * mine : (g + 1) * mine] for s in range(P)]) for t in full]
        y = F.scaled_dot_product_attention(*(t.reshape(mine, SEQ, HEAD_DIM) for t in lying), is_causal=causal)
        back.append(y.reshape(P * mine, local, HEAD_DIM)[rank * mine : (rank + 1) * mine])  # rank g's rows to us
    return torch.cat(back)


def placed(out: torch.Tensor, ref: torch.Tensor, r: int) -> str:
    """Where out's rows (one head at one position, d_h values each) lie in SDPA's output on the whole sequence
    `ref` (h, seq, d_h), this rank holding positions r seq/P ..: "" when every row is in its place; else, head by
    head, which block of SDPA's output each of out's misplaced heads holds (the first three), and how many rows
    are no row of it."""
    heads, local, seq = out.shape[0], out.shape[1], ref.shape[1]
    rows, want = out.detach().reshape(-1, out.shape[-1]), ref.detach().reshape(-1, ref.shape[-1])
    gap = torch.cdist(rows, want, compute_mode="donot_use_mm_for_euclid_dist")  # exact: no |a|^2 - 2ab + |b|^2
    found = [int(i) if gap[n, i] <= 1e-9 * want.abs().max() else None for n, i in enumerate(gap.argmin(1))]
    lost, mine = found.count(None), f"positions {r * local}..{(r + 1) * local - 1}"
    moved = [
        a for a in range(heads) if found[a * local : (a + 1) * local] != [a * seq + r * local + t for t in range(local)]
    ]
    if not moved:
        return ""
    words = []
    for a in moved[:3]:
        got = found[a * local : (a + 1) * local]
        if None in got:
            words.append(f"head {a}: {got.count(None)} of its rows are no row of SDPA's output")
        elif len({i // seq for i in got}) == 1 and [i % seq for i in got] == list(
            range(got[0] % seq, got[0] % seq + local)
        ):
            words.append(f"head {a} holds SDPA's head {got[0] // seq} at positions {got[0] % seq}..{got[-1] % seq}")
        else:
            words.append(f"head {a} holds SDPA's " + ", ".join(f"(head {i // seq}, position {i % seq})" for i in got))
    where = f"at {mine}, {len(moved)} of out's {heads} heads hold another block of SDPA's output: {'; '.join(words)}"
    if not lost:  # the attention ran right; only where its rows landed is wrong
        return f"every row of out is a row of SDPA's output (the attention right, its rows placed elsewhere); {where}"
    return where


def _ranks(rt, ulysses_attention, claims) -> None:
    group, index = _group(rt)
    P, r = dist.get_world_size(group), dist.get_rank(group)  # the group's size and this rank's place in it
    block = HEADS * (SEQ // P) * HEAD_DIM * 8
    full = _sequences(index)
    for causal in (False, True):  # every rank runs every case: none may leave a collective early
        name = "causal" if causal else "not causal"
        q, k, v, dout = (shard(t, r, P, "contiguous").requires_grad_(i < 3) for i, t in enumerate(full))
        with Watch() as watch:
            out = ulysses_attention(q, k, v, causal, Ledger(), group)
            if out.requires_grad:
                out.backward(dout)
        whole = [t.clone().requires_grad_() for t in full[:3]]
        ref = F.scaled_dot_product_attention(*whole, is_causal=causal)
        ref.backward(full[3])
        mine = [shard(t, r, P, "contiguous") for t in full[:3]]
        alternatives = {
            OWN: F.scaled_dot_product_attention(*mine, is_causal=causal),
            ARRIVAL: _arrival_order(full[:3], r, causal, P),
            BOTH_SIDES: _arrival_both_ways(full[:3], r, causal, P),
            NOT_CAUSAL: shard(F.scaled_dot_product_attention(*full[:3]), r, P, "contiguous"),
        }
        if group is not None:  # both groups' sequences one after the other, cut over the world's ranks
            ends = [torch.cat(ts, dim=1) for ts in zip(*(_sequences(g)[:3] for g in range(2)))]
            world = F.scaled_dot_product_attention(*ends, is_causal=causal)
            alternatives[WORLD] = shard(world, rt.rank, rt.world_size, "contiguous")
        claims.close(
            f"{name}: out equals SDPA's on the whole sequence",
            out.detach(),
            shard(ref.detach(), r, P, "contiguous"),
            what="out",
            alternatives=alternatives,
            note=placed(out, ref, r),
        )
        claims.tensors(
            f"{name}: dq, dk, dv equal SDPA's",
            {"dq": q.grad, "dk": k.grad, "dv": v.grad},
            {n: shard(t.grad, r, P, "contiguous") for n, t in zip(("dq", "dk", "dv"), whole)},
            what="the gradients of q, k, v",
        )
        claims.equal(
            f"{name}: bytes sent = 4 (P-1)/P blocks forward, as many backward",
            watch.sent(P),
            8 * (P - 1) * block / P,
            what="bytes sent (all-to-alls: the bytes that leave the rank; others: ring formulas)",
            note=f"collectives: {dict(watch.calls())}",
            hints=("an all-to-all sends each rank only its part: never gather what you do not keep",),
        )


MISTAKES = (
    Mistake(
        "attention over this rank's positions alone",
        "out equals",
        (Equals(OWN),),
        (
            "every query needs every key of the sequence, and this rank holds seq/P of them",
            "move q, k, v so that each rank holds every position of h/P heads, attend, move the result back",
            "all_to_all of x.reshape(h, seq/P d_h) with counts [h/P] * P, for q, k and v; then SDPA; then back",
        ),
    ),
    Mistake(
        "the arrived rows read in arrival order",
        "not causal: out equals",
        (Equals(ARRIVAL),),
        (
            "what arrives is P pieces, one per source rank, each h/P heads x seq/P positions: not yet a sequence",
            "put the source rank's dimension next to the positions before you merge them: (P, h/P, seq/P, d_h) "
            "-> (h/P, P, seq/P, d_h) -> (h/P, seq, d_h)",
            "rows.view(P, h // P, seq // P, d_h).transpose(0, 1).reshape(h // P, seq, d_h)",
        ),
    ),
    Mistake(
        "arrival order on both sides",
        "not causal: out equals",
        (Equals(BOTH_SIDES),),
        (
            "the two reshapes undo each other, so every output lands in its place, but the attention in between "
            "ran on rows that mix heads and positions",
            "the arrived pieces are (P, h/P, seq/P, d_h): bring the source rank next to the positions before the "
            "attention, and take it out again before sending back",
            "in: rows.view(P, h/P, seq/P, d_h).transpose(0, 1).reshape(h/P, seq, d_h); out: "
            "y.view(h/P, P, seq/P, d_h).transpose(0, 1).reshape(P h/P, seq/P d_h)",
        ),
    ),
    Mistake(
        "the all-to-alls on the whole world, not the group",
        "out equals",
        (Equals(WORLD),),
        (
            "the answer is handed its group: on a mesh, the sequence-parallel group is a few ranks, not the world",
            "an all-to-all without group= runs over every rank of the job, so the groups' sequences run together",
            "pass group on to both all-to-alls (seq_to_heads and heads_to_seq), and size the split by its size",
        ),
    ),
    Mistake(
        "the causal mask forgotten",
        "causal: out equals",
        (Equals(NOT_CAUSAL),),
        (
            "with whole sequences in hand, SDPA can mask them itself",
            "pass the causal flag on to scaled_dot_product_attention",
            "F.scaled_dot_product_attention(q_h, k_h, v_h, is_causal=causal)",
        ),
        holds=("not causal: out equals",),
    ),
    Mistake(
        "an all-to-all autograd cannot see",
        "dq, dk, dv equal",
        (Zero(),),
        (
            "out is right but no gradient reached q, k, v: the moves have no backward",
            "dist.all_to_all_single writes into a buffer autograd knows nothing of; the backward of an all-to-all "
            "is the reverse all-to-all",
            "distlab.comm.differentiable.all_to_all(rows, counts, counts, group, ledger), both ways",
        ),
        holds=("out equals",),
    ),
)


def whole_world(q, k, v, causal, ledger, group=None):
    """The group dropped: every all-to-all on the default group, the whole world."""
    return solution(LESSON, NAME).load()(q, k, v, causal, ledger)


def own_positions(q, k, v, causal, ledger, group=None):
    """No exchange at all: attention over the block this rank holds."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def _arrival(x, ledger, phases, group=None):
    p = dist.get_world_size(group)
    heads, local, head_dim = x.shape
    from distlab.comm.differentiable import all_to_all

    rows = all_to_all(x.reshape(heads, local * head_dim), [heads // p] * p, [heads // p] * p, group, ledger, phases)
    return rows.reshape(heads // p, p * local, head_dim)


def arrival_order(q, k, v, causal, ledger, group=None):
    """The arrived rows reshaped as they lie: source ranks and heads mixed into the positions."""
    with swapped(solution(LESSON, NAME), seq_to_heads=_arrival):
        return solution(LESSON, NAME).load()(q, k, v, causal, ledger, group)


def _arrival_back(y, ledger, phases, group=None):
    p = dist.get_world_size(group)
    mine, seq, head_dim = y.shape
    from distlab.comm.differentiable import all_to_all

    rows = all_to_all(y.reshape(p * mine, seq // p * head_dim), [mine] * p, [mine] * p, group, ledger, phases)
    return rows.view(p * mine, seq // p, head_dim)


def arrival_both_sides(q, k, v, causal, ledger, group=None):
    """No transpose on either side: the pieces read as they arrive, and the result cut as it lies."""
    with swapped(solution(LESSON, NAME), seq_to_heads=_arrival, heads_to_seq=_arrival_back):
        return solution(LESSON, NAME).load()(q, k, v, causal, ledger, group)


def never_causal(q, k, v, causal, ledger, group=None):
    """The causal flag dropped on the way to SDPA."""
    return solution(LESSON, NAME).load()(q, k, v, False, ledger, group)


def _untracked(x, send, recv, group=None, ledger=None, phases=("forward", "backward")):
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x.detach().contiguous(), list(recv), list(send), group=group)
    return out


def no_backward(q, k, v, causal, ledger, group=None):
    """dist.all_to_all_single with no autograd Function around it."""
    with swapped(solution(LESSON, NAME), all_to_all=_untracked):
        return solution(LESSON, NAME).load()(q, k, v, causal, ledger, group)


def gathered_sequence(q, k, v, causal, ledger, group=None):
    """Right numbers, the whole sequence's k and v all-gathered (P - 1 blocks each) instead of moved."""
    p, r = dist.get_world_size(group), dist.get_rank(group)
    local = q.shape[1]
    # lesson 23's gather (its backward a reduce-scatter), along dim 0: the positions first
    k_all, v_all = (gather_with_grad(t.transpose(0, 1).contiguous()).transpose(0, 1) for t in (k, v))
    mask = None
    if causal:
        positions = torch.arange(r * local, (r + 1) * local)
        mask = torch.arange(p * local)[None, :] <= positions[:, None]
    return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask)


# World sizes: P = 3 (the whole world) and P = 4 as two groups of two (also_at): an all-to-all that ignores its group
# runs the groups' sequences together.
EXERCISE = Exercise(
    LESSON,
    NAME,
    _ranks,
    P,
    MISTAKES,
    hints=(
        "attention mixes positions, never heads: give each rank whole sequences of fewer heads",
        "all-to-all q, k, v from (h, seq/P) to (h/P, seq): part q of the heads to rank q, the arrived pieces "
        "in rank order are the positions in order; SDPA; the reverse all-to-all for out",
        "rows = all_to_all(x.reshape(h, seq/P d_h), [h/P] * P, [h/P] * P, group, ledger); "
        "rows.view(P, h/P, seq/P, d_h).transpose(0, 1).reshape(h/P, seq, d_h)",
    ),
    numbers="equal",
    also_at=(PAIRS,),
)
WRONG = {
    "attention over this rank's positions alone": "own_positions",
    "the arrived rows read in arrival order": "arrival_order",
    "arrival order on both sides": "arrival_both_sides",
    "the causal mask forgotten": "never_causal",
    "the all-to-alls on the whole world, not the group": "whole_world",
    "an all-to-all autograd cannot see": "no_backward",
}
test_exercise, test_the_blank_is_not_written_yet, test_the_judge_names_the_mistake = EXERCISE.tests(
    Path(__file__), WRONG
)
test_the_judge_checks_beyond_numbers = EXERCISE.structure_test(Path(__file__), {"gathered_sequence": "bytes sent"})

test_the_judge_rejects_a_planted_slip = EXERCISE.audit_test(Path(__file__))
test_the_judge_rejects_a_second_slip = EXERCISE.audit_test(Path(__file__), second=True)
