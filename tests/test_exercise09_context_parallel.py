"""Exercise 09: ring attention's forward, judged on 4 ranks against torch's scaled_dot_product_attention
on the whole sequence in one process.

Each rank takes its zig-zag share of q, k, v and calls the answer, causal and not. The lesson's claims: this
rank's out and lse equal one process's (float64, rtol 1e-10); the k/v blocks went round the ring (2(P-1)
blocks sent); the causal tiles after the diagonal were skipped (the products computed equal the layout's
count); and per rank, at most two k/v blocks are alive at once beyond its own, the one folded and the one
arriving, never the whole sequence (the judge counts every block-shaped tensor the answer keeps alive).
Beside out's claim (and the tiles' count), which (query piece, key piece) tiles the rank folded and how masked,
by ring step, where they differ from the lesson's (read from the score tiles of the same run: `_Tiles`).
P = 4: at P = 3 holding every block costs no more than two in flight."""

from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F
from exercise_kit import Exercise, solution
from exercise_signatures import Equals, Mistake
from exercise_watch import Watch
from torch.utils._python_dispatch import TorchDispatchMode

from distlab.comm.ring import Ring
from distlab.layer_split.context_parallel.attention import Partial, causal_mask, fold_tile, scores
from distlab.layer_split.context_parallel.split import (
    SKIP,
    Layout,
    count_work,
    piece_label,
    pieces_of,
    shard,
    tile_kind,
)

LESSON, NAME = "context_parallel", "ring_forward"
P, HEADS, SEQ, HEAD_DIM = 4, 2, 24, 4
BLOCK_SHAPE = (HEADS, SEQ // P, HEAD_DIM)
BLOCK_CAUSAL = "attention with the diagonal tiles unmasked (a query sees its whole piece)"
WRONG_WAY = "attention with block a masked as if it were block 2r - a (the ring read the wrong way)"
OWN_BLOCK = "attention over this rank's own k/v block alone"
TRIANGLE = {"triangle": "masked with the diagonal's triangle"}
FUTURE = "attention with the tiles after the diagonal folded in unmasked (only the diagonal tiles masked)"


def _positions(rank: int) -> torch.Tensor:
    return torch.tensor([p for r in pieces_of(rank, P, SEQ, "zigzag") for p in r])


def _attention(q, k, v, visible: torch.Tensor) -> torch.Tensor:
    a = (q @ k.transpose(-1, -2) / HEAD_DIM**0.5).masked_fill(~visible, float("-inf"))
    return a.softmax(-1) @ v


def _misreadings(full: list, rank: int, causal: bool) -> dict:
    """This rank's out under each misreading, from the whole sequence in one process."""
    q, k, v = full
    mine, piece = _positions(rank), SEQ // (2 * P)
    if not causal:
        own = [shard(t, rank, P, "zigzag") for t in (k, v)]
        return {OWN_BLOCK: _attention(shard(q, rank, P, "zigzag"), *own, torch.ones(SEQ // P, SEQ // P, dtype=bool))}
    every = torch.arange(SEQ)
    believed = torch.empty(SEQ, dtype=torch.long)  # the position a key is masked as, when the ring runs backwards
    for a in range(P):
        believed[_positions(a)] = _positions((2 * rank - a) % P)
    q_r = shard(q, rank, P, "zigzag")
    return {
        BLOCK_CAUSAL: _attention(q_r, k, v, every[None] // piece <= mine[:, None] // piece),
        WRONG_WAY: _attention(q_r, k, v, believed[None] <= mine[:, None]),
        FUTURE: _attention(
            q_r, k, v, (every[None] // piece != mine[:, None] // piece) | (every[None] <= mine[:, None])
        ),
    }


class _Tiles(TorchDispatchMode):
    """Every score tile the answer formed, read from the tensors of its ops (in-place ones too): a tensor of shape
    (heads, piece, piece), or a few pieces each way, whose finite entries equal q_a k_b^T / sqrt(d_h) for one of
    this rank's query pieces a and one key piece b is tile (a, b); its -inf entries are its mask."""

    def __init__(self, q: torch.Tensor, k: torch.Tensor, rank: int):
        super().__init__()
        self.piece, self.found = SEQ // (2 * P), {}
        self.mine = [r.start // self.piece for r in pieces_of(rank, P, SEQ, "zigzag")]
        self.reference = q @ k.transpose(-1, -2) / HEAD_DIM**0.5  # the whole sequence's scores

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (list, tuple)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float64 and t.dim() == 3 and t.shape[0] == HEADS:
                if all(n % self.piece == 0 and 0 < n <= SEQ // P for n in t.shape[1:]):
                    self._read(t.detach().clone())
        return out

    def _read(self, t: torch.Tensor) -> None:
        n = self.piece
        for i in range(0, t.shape[1], n):
            for j in range(0, t.shape[2], n):
                tile = t[:, i : i + n, j : j + n]
                finite = tile.isfinite()
                if not finite.any() or not (finite == finite[0]).all():
                    continue
                for a in self.mine:
                    for b in range(2 * P):
                        want = self.reference[:, a * n : (a + 1) * n, b * n : (b + 1) * n]
                        if torch.allclose(tile[finite], want[finite], rtol=1e-9, atol=0):
                            masked = ~finite[0]  # the most entries masked of every version seen: the mask applied
                            if masked.sum() >= self.found.get((a, b), masked).sum():
                                self.found[(a, b)] = masked

    def unlike(self, rank: int, causal: bool) -> str:
        """Rank r's tiles that differ from the lesson's, by ring step ("" when none does): each (a, b) whole, masked
        with the diagonal's triangle (keys after the query's own position in the piece), masked otherwise, or never
        folded, against the lesson's whole, triangle or skipped."""
        triangle, steps = torch.ones(self.piece, self.piece, dtype=torch.bool).triu(1), {}
        for a, b in [(a, b) for a in self.mine for b in range(2 * P)]:
            lesson = "whole" if not causal or b < a else "triangle" if b == a else "skipped"
            mask = self.found.get((a, b))
            got = "never folded" if mask is None else "whole" if not mask.any() else "masked otherwise"
            got = "triangle" if mask is not None and torch.equal(mask, triangle) else got
            if got != lesson and (got, lesson) != ("never folded", "skipped"):
                words = {"triangle": f"{TRIANGLE['triangle']} (as if its queries and keys were one piece)"}
                item = f"({a}, {b}) {words.get(got, got)}, where the lesson's is {TRIANGLE.get(lesson, lesson)}"
                steps.setdefault((rank - (b if b < P else 2 * P - 1 - b)) % P, []).append(item)
        said = [
            f"step {s} (rank {(rank - s) % P}'s block, pieces {piece_label((rank - s) % P, P, SEQ)}): " + "; ".join(x)
            for s, x in sorted(steps.items())
        ]
        more = f"; steps {', '.join(map(str, sorted(steps)[2:]))} too" if len(said) > 2 else ""
        return (
            f"rank {rank}'s tiles (query piece, key piece) unlike the lesson's: " + "; ".join(said[:2]) + more
            if said
            else ""
        )


def _reference(q, k, v, causal):
    """One process, the whole sequence: out by SDPA, lse as the rows' log-sum-exp of the scores."""
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    a = q @ k.transpose(-1, -2) / HEAD_DIM**0.5
    if causal:
        a = a.masked_fill(torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1), float("-inf"))
    return out, a.logsumexp(-1)


def _ranks(rt, ring_forward, claims) -> None:
    gen = torch.Generator().manual_seed(4)
    full = [torch.randn(HEADS, SEQ, HEAD_DIM, generator=gen, dtype=torch.float64) * 2 for _ in range(3)]
    block = HEADS * (SEQ // P) * HEAD_DIM * 8
    for causal in (False, True):  # every rank runs every case: none may leave the ring early
        name = "causal" if causal else "not causal"
        layout = Layout(P, SEQ, "zigzag", causal)
        ring, tally = Ring(), Counter()
        mine = [shard(t, rt.rank, P, "zigzag") for t in full]
        with _Tiles(full[0], full[1], rt.rank) as tiles:  # outside the Watch: its copies are no answer's tensors
            with Watch(lambda shape: "k/v block" if shape == BLOCK_SHAPE else None) as watch:
                out, lse = ring_forward(ring, *mine, layout, tally)
                held = watch.peak["k/v block"]
        unlike = tiles.unlike(rt.rank, causal)  # beside the claims, never a claim of its own
        ref_out, ref_lse = _reference(*full, causal)
        out_ok = claims.close(
            f"{name}: out equals SDPA's on the whole sequence",
            out,
            shard(ref_out, rt.rank, P, "zigzag"),
            what="out",
            alternatives=_misreadings(full, rt.rank, causal),
            note=unlike,
        )
        claims.close(
            f"{name}: lse equals the rows' log-sum-exp",
            lse,
            shard(ref_lse.unsqueeze(-1), rt.rank, P, "zigzag").squeeze(-1),
            what="lse",
        )
        claims.equal(
            f"{name}: the k/v blocks went round the ring, 2(P-1) blocks sent",
            ring.ledger.sent,
            2 * (P - 1) * block,
            what="bytes sent",
            alternatives={"2P blocks: a move after the last step": 2 * P * block},
        )
        want = count_work(rt.rank, P, SEQ, "zigzag", causal).products
        claims.equal(
            f"{name}: the tiles after the diagonal were skipped",
            tally["products"],
            want,
            what="products counted",
            hints=("a tile whose keys all come after its queries adds only -inf: skip it, count what you fold",),
            note=unlike if out_ok else "",  # said once: with out's claim where that failed
        )
        claims.equal(
            f"{name}: at most two k/v blocks alive beyond my own, never the whole sequence",
            held,
            5,
            ok=held <= 5,
            what="block-shaped tensors alive at once (2 k/v pairs + out)",
            hints=("once the next block has arrived, the one you folded is no longer needed: drop it",),
        )


MISTAKES = (
    Mistake(
        "the diagonal tiles unmasked",
        "causal: out equals",
        (Equals(BLOCK_CAUSAL),),
        (
            "in a diagonal tile some keys come after some queries: a query may not see them",
            "fold a diagonal tile with the keys after each query masked to -inf; full tiles need no mask",
            "mask = causal_mask(query_positions, key_positions, device) for every tile tile_kind calls diagonal",
        ),
        holds=("not causal: out",),
    ),
    Mistake(
        "the tiles after the diagonal folded in",
        "causal: out equals",
        (Equals(FUTURE),),
        (
            "a query saw keys of later pieces: a tile whose keys all come after its queries must add nothing",
            "skipping those tiles is the causal mask at the tile's scale, not a speed-up: fold only tiles at or "
            "before the diagonal, and mask the diagonal ones",
            "if tile_kind(positions, key_positions, causal) == SKIP: continue",
        ),
    ),
    Mistake(
        "the ring read the wrong way",
        "causal: out equals",
        (Equals(WRONG_WAY),),
        (
            "the values are right without the mask: the blocks are all there, but whose positions are they?",
            "blocks arrive from the left neighbour: after k moves rank r holds rank r - k's block, not r + k's",
            "source = (ring.rank - step) % ring.world_size, and the mask from layout.pieces(source)",
        ),
        holds=("not causal: out",),
    ),
    Mistake(
        "the arriving block never used",
        "not causal: out equals",
        (Equals(OWN_BLOCK),),
        (
            "every step folds this rank's own keys again: the blocks you receive are never read",
            "after the step's math, wait for the posted exchange and fold the block it delivers next",
            "kv = tuple(arriving.wait()) at the end of each step",
        ),
    ),
    Mistake(
        "o not rescaled when the max grows",
        "out equals",
        (),
        (
            "lse is right, so m and l are: the output's running sum is the one off",
            "o was accumulated against an older max: when m grows to m', every term in o must shrink by "
            "exp(m - m') too, like l",
            "o' = o * exp(m - m') + exp(A - m') v  (fold_tile does it)",
        ),
        holds=("lse equals",),
    ),
    Mistake(
        "one move too many",
        "k/v blocks went round",
        (Equals("2P blocks: a move after the last step"),),
        (
            "after P - 1 moves every block has visited every rank",
            "post the exchange in steps 0 .. P-2 only: the last step folds what it holds and sends nothing",
            "arriving = ring.shift(*kv) if step < ring.world_size - 1 else None",
        ),
    ),
)


def _ring(slip: str | None, ring, qkv: tuple, layout, tally):
    """Ring attention as a learner writes it, with one slip (None: none): "no rescale", "no mask",
    "wrong way", "never swap", "extra move", "no skip", "future"."""
    q, k, v = qkv
    out, lse, mine, kv = torch.empty_like(q), q.new_empty(q.shape[:-1]), layout.pieces(ring.rank), (k, v)
    parts = [Partial.start(out[..., rows, :]) for rows, _ in mine]
    for step in range(ring.world_size):
        source = (ring.rank + (step if slip == "wrong way" else -step)) % ring.world_size
        arriving = ring.shift(*kv) if step < ring.world_size - 1 or slip == "extra move" else None
        for (rows, positions), part in zip(mine, parts):
            for cols, keys in layout.pieces(source):
                kind = tile_kind(positions, keys, layout.causal)
                if kind == SKIP and slip not in ("no skip", "future"):
                    continue
                masked = layout.causal and (slip != "no mask" or kind == SKIP) and (slip != "future" or kind != SKIP)
                mask = causal_mask(positions, keys, q.device) if masked else None
                if slip == "no rescale":
                    tile = scores(q[..., rows, :], kv[0][..., cols, :], mask)
                    new_max = torch.maximum(part.run_max, tile.amax(-1))
                    weights = (tile - new_max.unsqueeze(-1)).exp()
                    part.run_sum = part.run_sum * (part.run_max - new_max).exp() + weights.sum(-1)
                    part.out.add_(weights @ kv[1][..., cols, :])
                    part.run_max = new_max
                else:
                    fold_tile(part, q[..., rows, :], kv[0][..., cols, :], kv[1][..., cols, :], mask)
                tally[kind] += 1
                tally["products"] += len(positions) * len(keys)
        if arriving is not None:
            received = tuple(arriving.wait())
            kv = kv if slip == "never swap" else received
    for (rows, _), part in zip(mine, parts):
        part.finish(lse[..., rows])
    return out, lse


def no_rescale(ring, q, k, v, layout, tally):
    """o accumulated without rescaling it by exp(m - m') when the max grows (l rescaled right)."""
    return _ring("no rescale", ring, (q, k, v), layout, tally)


def no_diagonal_mask(ring, q, k, v, layout, tally):
    """The diagonal tiles folded whole: a query sees the later keys of its own piece."""
    return _ring("no mask", ring, (q, k, v), layout, tally)


def wrong_way(ring, q, k, v, layout, tally):
    """The block held after k moves taken for rank r + k's (it is rank r - k's)."""
    return _ring("wrong way", ring, (q, k, v), layout, tally)


def never_swapped(ring, q, k, v, layout, tally):
    """The exchange posted and waited for, but its block never put in place of the one folded."""
    return _ring("never swap", ring, (q, k, v), layout, tally)


def extra_move(ring, q, k, v, layout, tally):
    """Right numbers, a post in the last step too: P moves of the k/v block, not P - 1."""
    return _ring("extra move", ring, (q, k, v), layout, tally)


def skip_tiles_computed(ring, q, k, v, layout, tally):
    """Right numbers, the tiles after the diagonal folded fully masked instead of skipped."""
    return _ring("no skip", ring, (q, k, v), layout, tally)


def future_tiles_folded(ring, q, k, v, layout, tally):
    """The tiles after the diagonal folded in, unmasked: skipping taken for a speed-up."""
    return _ring("future", ring, (q, k, v), layout, tally)


class _Hoard:
    """A ring that keeps every block it delivers."""

    def __init__(self, ring: Ring):
        self.ring, self.kept = ring, []
        self.rank, self.world_size = ring.rank, ring.world_size

    def shift(self, *tensors):
        flight, hoard = self.ring.shift(*tensors), self.kept
        wait = flight.wait
        flight.wait = lambda: hoard.append(wait()) or hoard[-1]
        return flight


def every_block_kept(ring, q, k, v, layout, tally):
    """Right numbers, right bytes, but every block that arrives kept to the end: the whole sequence's k/v."""
    return solution(LESSON, NAME).load()(_Hoard(ring), q, k, v, layout, tally)


# World sizes: P = 4 only: at P = 3 every block held costs no more than two in flight; the zig-zag pairs differ at any
# P >= 2.
EXERCISE = Exercise(
    LESSON,
    NAME,
    _ranks,
    P,
    MISTAKES,
    hints=(
        "softmax over the whole sequence, one k/v block at a time: keep per query row a running max, sum and output",
        "P steps: post the block you hold to the right, fold each of its tiles into (m, l, o) (masked on the "
        "diagonal, skipped after it), then take the block that arrived from the left; out = o / l, lse = m + log l",
        "for step: source = (r - step) % P; arriving = ring.shift(*kv) if step < P - 1; for each tile: "
        "fold_tile(part, q_piece, k_piece, v_piece, mask); kv = arriving.wait()",
    ),
    numbers="out equals|lse equals",
)
WRONG = {
    "the diagonal tiles unmasked": "no_diagonal_mask",
    "the tiles after the diagonal folded in": "future_tiles_folded",
    "the ring read the wrong way": "wrong_way",
    "the arriving block never used": "never_swapped",
    "o not rescaled when the max grows": "no_rescale",
    "one move too many": "extra_move",
}
test_exercise, test_the_blank_is_not_written_yet, test_the_judge_names_the_mistake = EXERCISE.tests(
    Path(__file__), WRONG
)
test_the_judge_checks_beyond_numbers = EXERCISE.structure_test(
    Path(__file__),
    {"extra_move": "went round the ring", "skip_tiles_computed": "skipped", "every_block_kept": "alive"},
)

test_the_judge_rejects_a_planted_slip = EXERCISE.audit_test(Path(__file__))
test_the_judge_rejects_a_second_slip = EXERCISE.audit_test(Path(__file__), second=True)
