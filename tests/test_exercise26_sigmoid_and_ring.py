"""Exercise 26: the sigmoid ring by hand, judged on 3 ranks against one process on the whole batch.

Each rank passes its C x d image and text embeddings to the answer. The lesson's claims: G_x for its rows
and G_y for its pairs equal plain autograd of the sigmoid loss on the whole batch (float64); the bytes it
sent, as the judge sees them and as it reports them, equal (P - 1) C d + P C d elements; and no rank ever
holds N x d (the judge sees every tensor the answer makes)."""

from pathlib import Path

import torch
import torch.distributed as dist
from exercise_kit import Embeddings, Exercise
from exercise_signatures import Equals, Mistake, Scaled
from exercise_watch import Watch, spanning

from distlab.contrastive.losses import sigmoid_loss

LESSON, NAME = "sigmoid_and_ring", "ring_by_hand"
P, C, D, S, BETA = 3, 4, 5, 10.0, -10.0
N = P * C
OWN_ROWS = "G_y from this rank's own rows alone (the other ranks' shares lost)"
PREVIOUS = "G_y from rank r - 1's rows alone (the accumulator passed on, never added to)"
EVERY_BLOCK = "G_x with eps = +1 on the diagonal of every block, not of the whole batch"
UNTRANSPOSED = "G_y with each block's D where D^T belongs (s D Z_x, not s D^T Z_x)"


def _coefficients(x, y, eps) -> torch.Tensor:
    """D = -(1/N) eps sigma(-eps S) on the whole batch, for the misreadings."""
    return -eps * torch.sigmoid(-eps * (S * x @ y.T + BETA)) / N


def _misreadings(e: Embeddings, rank: int) -> tuple[dict, dict]:
    """What G_x and G_y are under each misreading, from the whole batch in one process."""
    x, y, mine, prev = e.full_x, e.full_y, e.rows, slice(((rank - 1) % P) * C, ((rank - 1) % P + 1) * C)
    d = _coefficients(x, y, 2 * torch.eye(N, dtype=x.dtype) - 1)
    blocks = 2 * torch.eye(C, dtype=x.dtype).repeat(P, P) - 1
    return (
        {EVERY_BLOCK: S * _coefficients(x, y, blocks)[mine] @ y},
        {
            OWN_ROWS: S * d[mine, mine].T @ x[mine],
            PREVIOUS: S * d[prev, mine].T @ x[prev],
            UNTRANSPOSED: S * sum(d[j * C : (j + 1) * C, mine] @ x[j * C : (j + 1) * C] for j in range(P)),
        },
    )


def logits_blocks(kept: list, z_x, full_y) -> str:
    """What the C x C tensors the answer formed say of its logits, block by block: "blocks 0, 1, 2: s z_x
    Z_y[j]^T + beta" when each block j's s x Y_j^T + beta was formed, else, for each block where it was not,
    the nearest form that was (the scale s or 1/s, the bias + beta, - beta or none), or "not formed"."""
    forms = {"s z_x Z_y[j]^T + beta": (S, BETA), "s z_x Z_y[j]^T - beta": (S, -BETA)}
    forms |= {"s z_x Z_y[j]^T, no beta": (S, 0.0), "z_x Z_y[j]^T / s + beta": (1 / S, BETA)}
    seen = {j: [] for j in range(P)}
    candidates = [
        (j, w, k * (z_x @ full_y[j * C : (j + 1) * C].T) + b) for j in range(P) for w, (k, b) in forms.items()
    ]
    for t in kept:
        seen_here = [(j, w) for j, w, want in candidates if torch.allclose(t, want, rtol=1e-9, atol=1e-12)]
        for j, w in seen_here:
            seen[j].append(w)
    right = [j for j in range(P) if "s z_x Z_y[j]^T + beta" in seen[j]]
    if len(right) == P:
        return f"blocks {', '.join(map(str, range(P)))}: s z_x Z_y[j]^T + beta"
    # a form with no bias is the step before the bias: the right block's, or the only one where nothing else was
    wrong = [
        f"block {j}: {next((w for w in seen[j] if 'no beta' not in w), None) or (seen[j] or ['not formed'])[0]}"
        for j in range(P)
        if j not in right
    ]
    return "; ".join(wrong)


def sigmoids_taken(kept: list, z_x, full_y, rank: int) -> str:
    """Which sigmoid of each block's logits S_j = s z_x Z_y[j]^T + beta the answer formed, read in eps_j (+1 on
    the diagonal of its own block j = r, -1 elsewhere): sigma(-eps S_j), the lesson's, or sigma(+eps S_j), the
    sign slipped (off the own block eps = -1, so these are sigma(S_j) and sigma(-S_j)). "" when every block
    took the lesson's; else the blocks grouped by the sigmoid they took ("neither ..." where neither was formed)."""
    taken = {}
    for j in range(P):
        logits = S * z_x @ full_y[j * C : (j + 1) * C].T + BETA
        eps = 2 * torch.eye(C, dtype=z_x.dtype) * (j == rank) - 1
        forms = {"sigma(-eps S_j)": torch.sigmoid(-eps * logits), "sigma(+eps S_j)": torch.sigmoid(eps * logits)}
        found = [w for w, want in forms.items() if any(torch.allclose(t, want, rtol=1e-9, atol=1e-12) for t in kept)]
        taken.setdefault(found[0] if found else "neither sigma(-eps S_j) nor sigma(+eps S_j)", []).append(j)
    if set(taken) == {"sigma(-eps S_j)"}:
        return ""
    words = "; ".join(f"block(s) {', '.join(map(str, js))}: {w}" for w, js in taken.items())
    return f"the sigmoid each block took, S_j = s z_x Z_y[j]^T + beta: {words}; the lesson's is sigma(-eps S_j)"


def _ranks(rt, ring, claims, seed: int) -> None:
    e = Embeddings.of(rt.rank, P, C, D, seed)
    rows = e.rows
    with Watch(keep=lambda shape: shape == (C, C)) as watch:
        g_x, g_y, reported = ring(rt, e.z_x.detach().clone(), e.z_y.detach().clone(), S, BETA)
    ref_x, ref_y = e.whole()
    sigmoid_loss(ref_x, ref_y, S, BETA).backward()  # plain autograd on the whole batch
    wrong_x, wrong_y = _misreadings(e, rt.rank)
    taken = sigmoids_taken(watch.kept, e.z_x.detach(), e.full_y, rt.rank)  # a description, never a claim
    claims.close(
        "G_x equals the whole batch's on my rows", g_x, ref_x.grad[rows], what="G_x", alternatives=wrong_x, note=taken
    )
    claims.close("G_y equals the whole batch's on my pairs", g_y, ref_y.grad[rows], what="G_y", alternatives=wrong_y)
    want, seen = 8 * ((P - 1) * C * D + P * C * D), watch.sent(P)
    claims.equal(
        "the bytes sent equal (P-1) C d + P C d elements, as reported",
        seen,
        want,
        ok=seen == want == reported,
        what="bytes the judge saw sent",
        note=f"you reported {reported}",
        hints=("P - 1 text blocks move, and P accumulators; count every tensor you hand to a send",),
    )
    formed = logits_blocks(watch.kept, e.z_x.detach(), e.full_y)
    claims.equal(
        "the logits of every block j are s z_x Z_y[j]^T + beta",
        formed,
        f"blocks {', '.join(map(str, range(P)))}: s z_x Z_y[j]^T + beta",
        what="the C x C logits the answer formed",
        hints=("each step's logits pair my rows with the text block it holds: s x Y_j^T + beta",),
    )
    claims.equal(
        "no rank holds N x d",
        spanning(watch.shapes, N, {D}),
        [],
        what="tensors N x d",
        hints=("the ring holds one text block at a time: G_x is a sum over blocks, built as they pass",),
    )


MISTAKES = (
    Mistake(
        "D where D^T belongs in G_y",
        "G_y equals",
        (Equals(UNTRANSPOSED),),
        (
            "G_x is right, G_y is not: the texts' gradient reads the coefficient matrix the other way",
            "D is (my images) x (block j's texts): the texts' share is s D^T Z_x, a sum down the columns",
            "mine = s * d.T @ x",
        ),
    ),
    Mistake(
        "the normaliser is C, not N",
        "G_x equals",
        (Scaled("P", lambda p: p),),
        (
            "the loss is a mean over all N = P C pairs' rows, not over one rank's C",
            "D = -(1/N) eps sigma(-eps S) with N the global batch",
            "divide by c * world_size, not by c",
        ),
    ),
    Mistake(
        "eps = +1 on every block's diagonal",
        "G_x equals",
        (Equals(EVERY_BLOCK),),
        (
            "a pair is positive only with its own partner: one diagonal in the whole N x N S",
            "block j of S holds positives only when j = r: the other blocks are all negatives",
            "labels = -1 everywhere, plus 2 I only when j == rt.rank",
        ),
    ),
    Mistake(
        "no traveling accumulator",
        "G_y equals",
        (Equals(OWN_ROWS),),
        (
            "G_y of your pairs needs every rank's rows: s D^T Z_x sums over all N images",
            "block j's share s D_rj^T x_r is added on rank r; the sum must travel from rank to rank to reach j",
            "after each block, send (what you received + s D_rj^T x) on to r + 1; after P hops it is home",
        ),
    ),
    Mistake(
        "the accumulator passed on without adding",
        "G_y equals",
        (Equals(PREVIOUS),),
        (
            "what arrives is the sum so far: your share must be added to it",
            "acc_j <- acc_j (received from r - 1) + s D_rj^T x_r, then sent on",
            "wait for the incoming accumulator and `mine += acc` before sending `mine`",
        ),
    ),
)


def _ring(rt, x, y, s, beta, slip: str | None):
    """The ring as a learner writes it, with one slip (None: none): "norm C", "every block", "own rows",
    "no add", "last send", "gathered x side", "no transpose"."""
    world, r, c = rt.world_size, rt.rank, len(x)
    nxt, prv, n = (r + 1) % world, (r - 1) % world, c * (world if slip != "norm C" else 1)
    g_x, block, acc, own, sent = torch.zeros_like(x), y, None, None, 0
    if slip == "gathered x side":
        every = torch.empty(world * c, x.shape[1], dtype=x.dtype)
        dist.all_gather_single(every, y.contiguous())
        sent += (world - 1) * y.nbytes
    for k in range(world):
        j = (r - k) % world
        if slip == "gathered x side":
            block = every[j * c : (j + 1) * c]
        elif k < world - 1 or slip == "last send":
            incoming = torch.empty_like(block)
            reqs, sent = [dist.isend(block, nxt), dist.irecv(incoming, prv)], sent + block.nbytes
        positive = 2 * torch.eye(c, dtype=x.dtype) if j == r or slip == "every block" else 0
        labels = -torch.ones(c, c, dtype=x.dtype) + positive
        d = -labels * torch.sigmoid(-labels * (s * x @ block.T + beta)) / n
        g_x += s * d @ block
        mine = s * (d if slip == "no transpose" else d.T) @ x
        own = mine if j == r else own
        if acc is not None and slip not in ("own rows", "no add"):
            mine += acc
        if slip != "own rows":
            acc = torch.empty_like(mine)
            for req in [dist.isend(mine, nxt), dist.irecv(acc, prv)]:
                req.wait()
            sent += mine.nbytes
        if slip != "gathered x side" and (k < world - 1 or slip == "last send"):
            for req in reqs:
                req.wait()
            block = incoming
    return g_x, (own if slip == "own rows" else acc), sent


def one_over_c(rt, x, y, s, beta):
    return _ring(rt, x, y, s, beta, "norm C")


def every_block_positive(rt, x, y, s, beta):
    return _ring(rt, x, y, s, beta, "every block")


def own_rows_only(rt, x, y, s, beta):
    return _ring(rt, x, y, s, beta, "own rows")


def accumulator_not_added(rt, x, y, s, beta):
    return _ring(rt, x, y, s, beta, "no add")


def untransposed(rt, x, y, s, beta):
    return _ring(rt, x, y, s, beta, "no transpose")


def block_sent_at_the_end(rt, x, y, s, beta):
    """Right numbers, a text block sent in the last step too: P C d feature elements, not (P - 1) C d."""
    return _ring(rt, x, y, s, beta, "last send")


def gathered_texts(rt, x, y, s, beta):
    """Right numbers and bytes, but every text block gathered at once for G_x: N x d on every rank."""
    return _ring(rt, x, y, s, beta, "gathered x side")


# World sizes: P = 3 only: the accumulator travels two hops (at P = 2 it is home after one).
EXERCISE = Exercise(
    LESSON,
    NAME,
    _ranks,
    P,
    MISTAKES,
    hints=(
        "the text blocks walk around the ring; G_y's pieces walk with them and come home",
        "at step k hold block j = r - k: add its tile's share to G_x, add s D_rj^T x into j's traveling "
        "accumulator, pass both on to r + 1",
        "d = -eps * sigmoid(-eps * (s * x @ block.T + beta)) / N; g_x += s * d @ block; "
        "acc_j = received + s * d.T @ x; isend block and acc_j to r + 1, irecv from r - 1",
    ),
    numbers="equals",
    args=(0,),
    quantities=lambda p: {"C": C, "N": p * C},
)
WRONG = {
    "the normaliser is C, not N": "one_over_c",
    "eps = +1 on every block's diagonal": "every_block_positive",
    "no traveling accumulator": "own_rows_only",
    "the accumulator passed on without adding": "accumulator_not_added",
    "D where D^T belongs in G_y": "untransposed",
}
test_exercise, test_the_blank_is_not_written_yet, test_the_judge_names_the_mistake = EXERCISE.tests(
    Path(__file__), WRONG
)
test_the_judge_checks_beyond_numbers = EXERCISE.structure_test(
    Path(__file__), {"block_sent_at_the_end": "bytes sent", "gathered_texts": "N x d"}
)

test_the_judge_rejects_a_planted_slip = EXERCISE.audit_test(Path(__file__))
test_the_judge_rejects_a_second_slip = EXERCISE.audit_test(Path(__file__), second=True)
