"""Exercise 22: a rank's local x global loss, judged on 3 ranks with the plain all-gather of lesson 22.

The reference is one process on the whole N x N logits: rank r's rows of the symmetric loss picked out of
S = s Z_x Z_y^T (its rows i and its columns i, for r's pairs). The lesson's claims: each rank's loss is its
rows' share; their mean is the full-batch loss (the loss is exact); the plain gather's gradient is the
gradient of the rank's own L_r alone, what lesson 22 shows is not the full batch's; and the logits are
C x N, never N x N (the judge sees every tensor the answer makes)."""

from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from exercise_kit import ROOT, Answer, Embeddings, Exercise
from exercise_signatures import Equals, Mistake, Scaled, all_but
from exercise_watch import Watch, spanning

from distlab.contrastive.gather import gather_plain
from distlab.contrastive.losses import clip_loss

LESSON, NAME = "contrastive_local_naive", "local_clip_loss"
P, C, D, S = 3, 4, 5, 10.0
N = P * C
NO_OFFSET, ROWS_ONLY = "the loss with the positives at columns 0 .. C-1", "the row direction (images) alone"
LOCAL_COLUMNS = "the loss with each column normalised over this rank's C rows only"
AS_TAU = "the loss with the logits divided by s, not multiplied (s read as the temperature tau)"


def _rows_loss(z_x, z_y, rows: slice, s: float = S) -> torch.Tensor:
    """Rank r's L_r read off the whole N x N logits (one process), at logit scale s."""
    logits = s * z_x @ z_y.T
    nll_rows = -torch.log_softmax(logits, 1).diagonal()[rows]
    nll_cols = -torch.log_softmax(logits, 0).diagonal()[rows]
    return (nll_rows.mean() + nll_cols.mean()) / 2


def _alternatives(z_x, z_y, rows: slice) -> dict[str, float]:
    """What rank r's loss is under each misreading, from the whole logits."""
    logits, first = S * z_x @ z_y.T, torch.arange(C)
    mine = logits[rows]
    return {
        NO_OFFSET: ((F.cross_entropy(mine, first) + F.cross_entropy(logits.T[rows], first)) / 2).item(),
        ROWS_ONLY: F.cross_entropy(mine, torch.arange(rows.start, rows.stop)).item(),
        LOCAL_COLUMNS: (
            (F.cross_entropy(mine, torch.arange(rows.start, rows.stop)) + F.cross_entropy(mine[:, rows].T, first)) / 2
        ).item(),
        AS_TAU: _rows_loss(z_x, z_y, rows, 1 / S).item(),
    }


LOGITS = ("z_x Z_y^T", "z_y Z_x^T")  # the two directions' products; the others pair a tower with itself


def products(kept: list, z_x, z_y, full_x, full_y) -> str:
    """Which of the products a local loss may form the answer computed, at which scale: each C x N (or N x C,
    transposed) tensor it made, read as k a B^T for a in {z_x, z_y}, B in {Z_x, Z_y}, k in {s, 1/s, 2 s, s/2}
    ("s z_x Z_y^T"). An unscaled product is left out where the same pair was also formed at a scale (the step
    before it), else named "z_y Z_x^T (unscaled)": those logits were never scaled. Each name once, sorted,
    joined by "and"; "none of them" when it formed none."""
    pairs = {"z_x Z_y^T": z_x @ full_y.T, "z_y Z_x^T": z_y @ full_x.T, "z_x Z_x^T": z_x @ full_x.T}
    pairs["z_y Z_y^T"] = z_y @ full_y.T
    scales = {"s": S, "1/s": 1 / S, "2 s": 2 * S, "s/2": S / 2, "": 1.0}
    found = set()
    for t in kept:
        t = t.T if t.shape != (len(z_x), len(full_x)) else t
        for pair, product in pairs.items():
            for word, k in scales.items():
                if t.shape == product.shape and torch.allclose(t, k * product, rtol=1e-9, atol=1e-12):
                    found.add(f"{word} {pair}".strip())
    scaled = {" ".join(name.split()[-2:]) for name in found if len(name.split()) > 2}
    found = {name if len(name.split()) > 2 else f"{name} (unscaled)" for name in found if name not in scaled}
    return " and ".join(sorted(found)) or "none of them"


def _ranks(rt, local_clip_loss, claims) -> None:
    e = Embeddings.of(rt.rank, P, C, D, 3)
    full_x, full_y, rows, z_x, z_y = e.full_x, e.full_y, e.rows, e.z_x, e.z_y
    all_x, all_y = gather_plain(z_x), gather_plain(z_y)
    with Watch(keep=lambda shape: shape in ((C, N), (N, C))) as watch:
        loss = local_clip_loss(z_x, z_y, all_x, all_y, S, rt.rank * C)
    ref_x, ref_y = e.whole()
    ref = _rows_loss(ref_x, ref_y, rows)
    claims.equal(
        "your loss is rank r's rows of the symmetric loss",
        loss.item(),
        ref.item(),
        ok=abs(loss.item() - ref.item()) < 1e-10,
        what="L_r",
        alternatives=_alternatives(full_x, full_y, rows),
    )
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    whole = clip_loss(full_x, full_y, S).item()
    claims.equal(
        "the mean over ranks equals the full-batch loss",
        mean.item() / P,
        whole,
        ok=abs(mean.item() / P - whole) < 1e-10,
        what="mean of the L_r",
    )
    loss.backward()
    ref.backward()
    for name, got, want in (("z_x", z_x.grad, ref_x.grad[rows]), ("z_y", z_y.grad, ref_y.grad[rows])):
        claims.close(f"the plain gather's gradient at {name} is dL_r/d{name} alone", got, want, what=f"dL/d{name}")
    claims.equal(
        "the logits are s z_x Z_y^T and s z_y Z_x^T: this rank's rows of S and of S^T",
        products(watch.kept, z_x.detach(), z_y.detach(), full_x, full_y),
        f"s {LOGITS[0]} and s {LOGITS[1]}",
        what="the C x N products the answer computed",
        hints=("row i of S pairs image i with every text; row i of S^T pairs text i with every image",),
    )
    wide = spanning(watch.shapes, N, {N})
    claims.equal(
        "the logits are C x N, never N x N",
        wide,
        [],
        what="tensors N x N",
        hints=("a rank's loss needs its own rows of S and of S^T only",),
    )


MISTAKES = (
    Mistake(
        "s read as the temperature",
        "your loss is rank r",
        (Equals(AS_TAU),),
        (
            "the logits are s times the similarities: s = 1/tau is a scale, large for a sharp softmax",
            "S = s Z_x Z_y^T: multiply by the logit scale (divide only by a temperature tau)",
            "logits = s * local_z_x @ all_z_y.T, and the same for the texts",
        ),
    ),
    Mistake(
        "the positives at the first rank's columns",
        "rank r's rows",
        (all_but(0), Equals(NO_OFFSET)),
        (
            "the gathered Z puts rank 0's pairs first: where does your row i's positive sit?",
            "local row i of rank r is global pair rC + i: its positive is column offset + i",
            "labels = torch.arange(offset, offset + C)",
        ),
    ),
    Mistake(
        "the two directions added, not averaged",
        "rank r's rows",
        (Scaled("2", lambda p: 2),),
        (
            "the symmetric loss is the mean of its two directions",
            "L_r = (row cross-entropy + column cross-entropy) / 2",
            "divide the sum of the two cross-entropies by 2",
        ),
    ),
    Mistake(
        "one direction only",
        "rank r's rows",
        (Equals(ROWS_ONLY),),
        (
            "CLIP's loss is symmetric: the texts pick their images too",
            "column i of S is row i of S^T: s z_y,i Z_x^T, normalised over all N images",
            "add F.cross_entropy(s * local_z_y @ all_z_x.T, labels), then halve",
        ),
    ),
    Mistake(
        "each column normalised over this rank's rows only",
        "rank r's rows",
        (Equals(LOCAL_COLUMNS),),
        (
            "a column of S has N entries, one per image of the whole batch, not C",
            "the column loss of pair i normalises over every image: use row i of S^T = s z_y,i Z_x^T",
            "F.cross_entropy(s * local_z_y @ all_z_x.T, labels), not a softmax down your C x C block",
        ),
    ),
)


def divided_by_s(local_z_x, local_z_y, all_z_x, all_z_y, s, offset):
    """The logits divided by the scale, as if it were tau."""
    labels = torch.arange(offset, offset + len(local_z_x))
    return (F.cross_entropy(local_z_x @ all_z_y.T / s, labels) + F.cross_entropy(local_z_y @ all_z_x.T / s, labels)) / 2


def labels_without_offset(local_z_x, local_z_y, all_z_x, all_z_y, s, offset):
    """Every rank's positives at columns 0 .. C-1 (rank 0's pairs)."""
    labels = torch.arange(len(local_z_x))
    return (F.cross_entropy(s * local_z_x @ all_z_y.T, labels) + F.cross_entropy(s * local_z_y @ all_z_x.T, labels)) / 2


def directions_added(local_z_x, local_z_y, all_z_x, all_z_y, s, offset):
    """The two directions summed: 2 L_r."""
    labels = torch.arange(offset, offset + len(local_z_x))
    return F.cross_entropy(s * local_z_x @ all_z_y.T, labels) + F.cross_entropy(s * local_z_y @ all_z_x.T, labels)


def rows_only(local_z_x, local_z_y, all_z_x, all_z_y, s, offset):
    """Images pick their texts; the texts never pick their images."""
    return F.cross_entropy(s * local_z_x @ all_z_y.T, torch.arange(offset, offset + len(local_z_x)))


def local_columns(local_z_x, local_z_y, all_z_x, all_z_y, s, offset):
    """The column direction as a softmax down this rank's own C x C block of S (C images, not N)."""
    c, labels = len(local_z_x), torch.arange(offset, offset + len(local_z_x))
    logits = s * local_z_x @ all_z_y.T
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits[:, offset : offset + c].T, torch.arange(c))) / 2


def whole_logits(local_z_x, local_z_y, all_z_x, all_z_y, s, offset):
    """Right numbers, N x N logits: the whole S built, then this rank's rows and columns read off it."""
    logits, c = s * all_z_x @ all_z_y.T, len(local_z_x)
    labels = torch.arange(offset, offset + c)
    return (
        F.cross_entropy(logits[offset : offset + c], labels) + F.cross_entropy(logits.T[offset : offset + c], labels)
    ) / 2


# World sizes: P = 3 only: rank 1's positives sit neither at the first nor at the last columns.
EXERCISE = Exercise(
    LESSON,
    NAME,
    _ranks,
    P,
    MISTAKES,
    hints=(
        "a rank owns C pairs: its share of the loss is its rows of S and its rows of S^T",
        "rows of S are s z_x,i Z_y^T and rows of S^T are s z_y,i Z_x^T, each C x N; the positive of local "
        "row i is global column offset + i",
        "average F.cross_entropy(s * local_z_x @ all_z_y.T, labels) and the same with x and y swapped, "
        "labels = torch.arange(offset, offset + C)",
    ),
    numbers="loss|mean|gradient",
    solution_at=Answer(ROOT / "src/distlab/contrastive/losses.py", NAME),
    quantities=lambda p: {"C": C, "N": p * C},
)
WRONG = {
    "s read as the temperature": "divided_by_s",
    "the positives at the first rank's columns": "labels_without_offset",
    "the two directions added, not averaged": "directions_added",
    "one direction only": "rows_only",
    "each column normalised over this rank's rows only": "local_columns",
}
test_exercise, test_the_blank_is_not_written_yet, test_the_judge_names_the_mistake = EXERCISE.tests(
    Path(__file__), WRONG
)
test_the_judge_checks_beyond_numbers = EXERCISE.structure_test(Path(__file__), {"whole_logits": "never N x N"})

test_the_judge_rejects_a_planted_slip = EXERCISE.audit_test(Path(__file__))
test_the_judge_rejects_a_second_slip = EXERCISE.audit_test(Path(__file__), second=True)
