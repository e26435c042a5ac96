"""Exercise 23: the sum-backward all-gather, judged on 3 ranks against one process on the whole batch.

Each rank gathers its C rows of Z_x and Z_y with the answer, computes its own C rows of the symmetric
InfoNCE (`local_clip_loss`) and back-propagates. The lesson's claims: the gathered Z equals every rank's
block in order; the gradient at each rank's embeddings equals P times the full-batch gradient there (each
rank's loss is a mean over its C rows, and sum_s L_s = P L), the factor DDP's average then removes; and the
exchange costs no more than the lesson's, an all-gather forward and an all-reduce backward of N x d
(the judge prices the collectives it sees by the ring formulas); and the sum reaches every rank by the
collective's contract, not by what gloo happens to leave (a reduce to one rank is refused)."""

from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.distributed.nn.functional as dist_nn
from exercise_kit import Embeddings, Exercise
from exercise_signatures import Equals, Mistake, all_but
from exercise_watch import Watch

from distlab.contrastive.gather import gather_plain
from distlab.contrastive.losses import clip_loss, local_clip_loss

LESSON, NAME = "contrastive_allgather_fix", "gather_all_reduce"
P, C, D, TAU = 3, 4, 5, 0.1
N_D_BYTES = P * C * D * 8  # one N x d tensor of float64
OWN_LOSS = "the gradient of this rank's own L_r alone"
MEAN = "its local term plus the mean over ranks of the gathered term"
FIRST_ROWS = "its local term plus the gathered term of rank 0's rows"
OWN_ROWS = "its local term plus the sum over ranks s of L_s's gathered term at s's own rows (each rank's rows reduced)"


def _ranks(rt, gather, claims, seed: int) -> None:
    e = Embeddings.of(rt.rank, P, C, D, seed)
    full_x, rows, z_x, z_y = e.full_x, e.rows, e.z_x, e.z_y
    with Watch() as watch:
        all_x, all_y = gather(z_x), gather(z_y)
        claims.close("the forward gathers every rank's block in rank order", all_x, full_x, what="Z_x", tol=1e-15)
        local_clip_loss(z_x, z_y, all_x, all_y, 1 / TAU, rt.rank * C).backward()
    ref_x, ref_y = e.whole()
    clip_loss(ref_x, ref_y, 1 / TAU).backward()
    misreadings, terms = _misreadings(e, rows)
    for name, got, ref, alternatives in zip(("z_x", "z_y"), (z_x.grad, z_y.grad), (ref_x, ref_y), misreadings):
        claims.close(
            f"the gradient at {name} equals P x the full batch's",
            got,
            P * ref.grad[rows],
            what=f"dL/d{name}",
            alternatives=alternatives,
        )
    local, summed = terms[0]  # what the backward returned at z_x: the gradient less its local use
    returned = rows_of(z_x.grad - local if z_x.grad is not None else None, summed, C)
    claims.equal(
        "the backward returns rows rC .. rC + C - 1 of the sum over ranks",
        returned,
        f"rows {rt.rank * C}..{rt.rank * C + C - 1} of the sum",
        what="what the backward returned at z_x",
        hints=("rank r's rows of the N x d sum start at r C, not at r: remember r and C in forward",),
    )
    # A reduce leaves the sum on its destination only; gloo happens to leave it on every rank at these sizes
    # (so every number above can hold), NCCL does not: the contract is read from the collectives run.
    reduces = watch.calls()["reduce"]
    claims.holds(
        "the backward's sum reaches every rank (no reduce to one rank)",
        reduces == 0,
        what="the collectives the answer ran",
        note=f"{reduces} reduce(s) to one rank ran: a reduce leaves the sum on its dst alone, the other ranks' "
        "rows are whatever the transport left there (gloo leaves the sum at these sizes, NCCL does not)",
        hints=("every rank returns its own rows of the sum: the sum must end on every rank, not on one",),
    )
    bound = 2 * (P - 1) / P * N_D_BYTES + 2 * 2 * (P - 1) / P * N_D_BYTES  # two gathers, two all-reduces
    claims.equal(
        "bytes sent <= two all-gathers and two all-reduces of N x d",
        watch.sent(P),
        bound,
        ok=watch.sent(P) <= bound * (1 + 1e-12),
        what="bytes sent (ring formulas)",
        note=f"collectives: {dict(watch.calls())}",
        hints=("backward needs the sum over ranks of an N x d gradient: one collective does exactly that",),
    )


def _misreadings(e: Embeddings, rows: slice) -> tuple[list[dict], list[tuple]]:
    """In one process: every rank's loss L_s reads its own rows as local leaves A and everyone's as the
    gathered leaves B, so A.grad[rows r] = dL_r/dz_r through its local use, B.grad[rows r] = sum_s dL_s/dZ
    there. The exact gradient is their sum; each misreading keeps another part of the B term. Also each
    tensor's (local term at this rank's rows, the whole N x d sum B.grad): what the backward should return."""
    (a_x, a_y), (b_x, b_y) = e.whole(), e.whole()
    for s in range(P):
        mine = slice(s * C, (s + 1) * C)
        local_clip_loss(a_x[mine], a_y[mine], b_x, b_y, 1 / TAU, s * C).backward()
    own_x, own_y = e.whole()
    local_clip_loss(own_x[rows], own_y[rows], own_x, own_y, 1 / TAU, rows.start).backward()
    at_own = [0, 0]  # sum_s dL_s/dZ at rank s's own rows, through the gathered leaves: what each rank reduces
    for s in range(P):
        mine, (a_sx, a_sy), (b_sx, b_sy) = slice(s * C, (s + 1) * C), e.whole(), e.whole()
        local_clip_loss(a_sx[mine], a_sy[mine], b_sx, b_sy, 1 / TAU, s * C).backward()
        at_own = [at_own[0] + b_sx.grad[mine], at_own[1] + b_sy.grad[mine]]
    return [
        {
            OWN_LOSS: own.grad[rows],
            MEAN: a.grad[rows] + b.grad[rows] / P,
            FIRST_ROWS: a.grad[rows] + b.grad[:C],
            OWN_ROWS: a.grad[rows] + reduced,
        }
        for own, a, b, reduced in ((own_x, a_x, b_x, at_own[0]), (own_y, a_y, b_y, at_own[1]))
    ], [(a_x.grad[rows], b_x.grad), (a_y.grad[rows], b_y.grad)]


def rows_of(returned, summed, c: int) -> str:
    """Which C consecutive rows of the N x d sum `returned` is, and by what factor: "rows 1..4 of the sum",
    "rows 4..7 of the sum x 0.333333", or "no C consecutive rows of the sum" (a sum of other rows, zeros)."""
    if returned is None or returned.shape != summed[:c].shape:
        return "no C consecutive rows of the sum"
    for k in range(len(summed) - c + 1):
        window = summed[k : k + c]
        f = (returned * window).sum().item() / max((window * window).sum().item(), 1e-300)
        if f and torch.allclose(returned, f * window, rtol=1e-9, atol=1e-12):
            scaled = "" if abs(f - 1) < 1e-9 else f" x {f:.6g}"
            return f"rows {k}..{k + c - 1} of the sum{scaled}"
    return "no C consecutive rows of the sum"


MISTAKES = (
    Mistake(
        "the plain gather's backward (this rank's loss only)",
        "gradient at z_x",
        (Equals(OWN_LOSS),),
        (
            "every rank's loss reads your rows of Z: their gradients are spread over the ranks",
            "backward must add up, over all ranks s, the gradient L_s sends to your rows",
            "in backward: all-reduce (sum) a copy of the N x d gradient, return your C rows",
        ),
    ),
    Mistake(
        "the ranks' gradients averaged, not summed",
        "gradient at z_x",
        (Equals(MEAN),),
        (
            "dL/dz_r is a sum over the ranks' losses, not their mean",
            "sum_s dL_s/dZ: the reduction must be a SUM (DDP's average comes later, once)",
            "dist.all_reduce(summed, op=dist.ReduceOp.SUM), and no division",
        ),
    ),
    Mistake(
        "only this rank's rows of the gradient all-reduced",
        "gradient at z_x",
        (Equals(OWN_ROWS),),
        (
            "each rank reduced only the rows it returns, so the sum added different ranks' rows together",
            "all-reduce the whole N x d gradient: rank s's loss sends gradient to every rank's rows, then cut rows r",
            "summed = grad.contiguous().clone(); dist.all_reduce(summed); return summed[r C : (r + 1) C]",
        ),
    ),
    Mistake(
        "rank 0's rows returned on every rank",
        "gradient at z_x",
        (all_but(0), Equals(FIRST_ROWS)),
        (
            "the summed gradient is N x d; each rank needs its own C rows of it",
            "rank r's rows are r C .. r C + C - 1 (remember r and C in forward)",
            "return summed[ctx.rank * ctx.c : (ctx.rank + 1) * ctx.c]",
        ),
    ),
)


class _Averaged(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z):
        ctx.rank, ctx.c = dist.get_rank(), len(z)
        out = z.new_empty((dist.get_world_size() * len(z), *z.shape[1:]))
        dist.all_gather_single(out, z.contiguous())
        return out

    @staticmethod
    def backward(ctx, grad):
        mean = grad.contiguous().clone()
        dist.all_reduce(mean)
        return (mean / dist.get_world_size())[ctx.rank * ctx.c : (ctx.rank + 1) * ctx.c]


class _FirstRows(_Averaged):
    @staticmethod
    def backward(ctx, grad):
        summed = grad.contiguous().clone()
        dist.all_reduce(summed)
        return summed[: ctx.c]


class _OwnRowsReduced(_Averaged):
    @staticmethod
    def backward(ctx, grad):
        mine = grad[ctx.rank * ctx.c : (ctx.rank + 1) * ctx.c].contiguous().clone()
        dist.all_reduce(mine)  # every rank's own rows of its own gradient, added: rows of different ranks
        return mine


class _GatheredBackward(_Averaged):
    @staticmethod
    def backward(ctx, grad):
        every = grad.new_empty((dist.get_world_size() * len(grad), *grad.shape[1:]))
        dist.all_gather_single(every, grad.contiguous())
        return every.view(-1, *grad.shape).sum(0)[ctx.rank * ctx.c : (ctx.rank + 1) * ctx.c]


class _ReducedToOne(_Averaged):
    @staticmethod
    def backward(ctx, grad):
        summed = grad.contiguous().clone()
        dist.reduce(summed, dst=0)  # the sum on rank 0 by contract; gloo leaves it everywhere at these sizes
        return summed[ctx.rank * ctx.c : (ctx.rank + 1) * ctx.c]


# The plain gather (lesson 22's), whose backward keeps only this rank's own loss's term.
plain_gather = gather_plain


def averaged(z):
    """The all-reduce's sum divided by P: the mean over ranks where the sum belongs."""
    return _Averaged.apply(z)


def first_rows(z):
    """The summed gradient, but its first C rows on every rank."""
    return _FirstRows.apply(z)


def own_rows_reduced(z):
    """Only the rows each rank returns all-reduced: the ranks' different rows added together."""
    return _OwnRowsReduced.apply(z)


def gathered_backward(z):
    """Right numbers, P times the bytes: every rank's whole N x d gradient all-gathered, summed here."""
    return _GatheredBackward.apply(z)


def reduced_to_one(z):
    """Right numbers on gloo, wrong by contract: the sum reduced to rank 0, whose other ranks keep whatever the
    transport left (gloo the sum at these sizes, NCCL not)."""
    return _ReducedToOne.apply(z)


def library_gather(z):
    """Right, written another way: torch.distributed.nn.functional.all_gather, whose backward sums the
    ranks' gradients (the library gather lesson 23 names); on gloo it runs as P scatters."""
    return torch.cat(dist_nn.all_gather(z))


def functional_gather(z):
    """Right, written another way: the functional collectives' autograd all-gather (backward: a
    reduce-scatter of the N x d gradient, summing)."""
    return funcol.all_gather_tensor_autograd(z, 0, dist.group.WORLD)


# World sizes: P = 3 only: the sum over three ranks' gradients is apart from their mean and from rank 0's rows.
EXERCISE = Exercise(
    LESSON,
    NAME,
    _ranks,
    P,
    MISTAKES,
    hints=(
        "the forward is an all-gather; what makes it exact is its backward",
        "the gradient reaching z_r is the sum over every rank s of what L_s sends to Z's rows of r",
        "an autograd.Function: forward all_gather_single into an N x d tensor; backward all_reduce a copy "
        "of grad (SUM) and return its rows r C .. r C + C - 1",
    ),
    numbers="gathers every|gradient",
    args=(0,),
    quantities=lambda p: {"C": C, "N": p * C},
)
WRONG = {
    "the plain gather's backward (this rank's loss only)": "plain_gather",
    "the ranks' gradients averaged, not summed": "averaged",
    "rank 0's rows returned on every rank": "first_rows",
    "only this rank's rows of the gradient all-reduced": "own_rows_reduced",
}
test_exercise, test_the_blank_is_not_written_yet, test_the_judge_names_the_mistake = EXERCISE.tests(
    Path(__file__), WRONG
)
test_the_judge_checks_beyond_numbers = EXERCISE.structure_test(
    Path(__file__), {"gathered_backward": "bytes sent", "reduced_to_one": "reaches every rank"}
)
test_the_judge_accepts_another_way = EXERCISE.accepts_test(Path(__file__), ["library_gather", "functional_gather"])

test_the_judge_rejects_a_planted_slip = EXERCISE.audit_test(Path(__file__))
test_the_judge_rejects_a_second_slip = EXERCISE.audit_test(Path(__file__), second=True)
