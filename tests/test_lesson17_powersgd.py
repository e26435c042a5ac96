"""Lesson 17: PowerSGD by hand as a DDP communication hook equals torch's powerSGD_hook bit for bit (Gram-Schmidt at
ell <= 2, Householder QR above, as torch) with torch's options (no error feedback, no warm start, a later or an
earliest start, an orthogonalisation epsilon), with biases compressed (rate < 1), same-shaped matrices apart in the
bucket, and ell beyond the gradient's rank (where Gram-Schmidt alone would be 1e-4 off); a zero gradient gives NaN
in both at ell <= 2 without epsilon, the same finite result with it, none under QR; it equals the same low-rank
algebra in one process on the P shares of the batch (bit for bit at P = 1, 2; 1e-12 at P = 3, 4), and differs from
uncompressed DDP; the equality checks fail on wrong hooks (no error feedback, no 1/P on V, no warm start); the
bytes handed to the all-reduces equal e [sum (n + m) ell over the compressed matrices + the rest whole], with the
minimum compression rate's skip; a rank ell larger than a weight matrix is one line naming --approx-rank on every
rank."""

import argparse

import pytest
import torch
from helpers import (
    assert_flag_refused,
    assert_lesson_passes_at_80_columns,
    assert_same_error_on_every_rank,
    load_lesson,
)
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd

from distlab.processes.spawn import spawn
from distlab.proof.models import layered_mlp

WIDTH, LAYERS, N, STEPS = 24, 2, 24, 6  # widths 16, 24, 24, 8: P = 1, 2, 3, 4 divide N


def _args(**changes) -> argparse.Namespace:
    args = dict(
        width=WIDTH, layers=LAYERS, global_batch=N, steps=STEPS, lr=0.2, seed=3, approx_rank=2, min_compression_rate=2.0
    )
    return argparse.Namespace(**{**args, **changes})


# ---- wrong hooks: the lesson's, with one piece left out ---------------------------------------------------


def no_error_feedback(hook, state, bucket):
    """The error E_p dropped after every step: what compression loses is lost for good."""
    future = hook(state, bucket)
    state.errors.clear()
    return future


def v_not_averaged(hook, state, bucket):
    """V summed over the ranks and never divided by P: every compressed gradient P times too large."""
    lesson = load_lesson("powersgd")
    future = hook(state, bucket)
    if state.step > lesson.START_ITER:  # a compressed step just ran: undo the 1/P on the gradients it wrote
        for g in bucket.gradients():
            if lesson.compressed_rank(g.shape, state.ell, state.min_compression_rate):
                g.mul_(torch.distributed.get_world_size())
    return future


def cold_start(hook, state, bucket):
    """A fresh random V every step (no warm start): one power iteration from scratch each time."""
    state.vs.clear()
    return hook(state, bucket)


WRONG = {"no error feedback": no_error_feedback, "V not averaged": v_not_averaged, "cold start": cold_start}


def _wrong(wrong, right):
    """The lesson's hook with one piece wrong, as a function DDP accepts (a name, two parameters)."""

    def hook(state, bucket):
        return wrong(right, state, bucket)

    return hook


def _gram_schmidt_only(hook, state, bucket):
    """Gram-Schmidt at every ell (no switch to QR above 2): unstable when ell exceeds the rank of M V."""
    lesson = load_lesson("powersgd")
    right = lesson.orthonormalise

    def gram_schmidt(columns, epsilon=0.0):
        for i in range(columns.shape[1]):
            col = columns[:, i]
            col /= torch.norm(col) + epsilon
            for j in range(i + 1, columns.shape[1]):
                later = columns[:, j]
                later -= torch.sum(col * later) * col

    lesson.orthonormalise = gram_schmidt
    try:
        return hook(state, bucket)
    finally:
        lesson.orthonormalise = right


def _problem(widths=None, zero_inputs=False):
    """make_problem with other widths, or inputs all zero (every first-layer weight gradient is zero)."""
    lesson = load_lesson("powersgd")
    right = lesson.make_problem

    def make(args):
        model, (x, y) = right(args)
        if widths:
            model = layered_mlp(widths, seed=args.seed)
        return model, (torch.zeros_like(x) if zero_inputs else x, y)

    return make


def _cases():
    """(name, args, options, problem): each run at P = 2 by hand and by torch's hook."""
    lesson = load_lesson("powersgd")
    opt = lesson.Options
    return [
        ("no error feedback", _args(), opt(use_error_feedback=False), None),
        ("cold start, QR", _args(approx_rank=4), opt(warm_start=False), None),
        ("start at 4", _args(), opt(start_powerSGD_iter=4), None),
        ("epsilon", _args(), opt(orthogonalization_epsilon=1e-8), None),
        ("start at 0, stateless", _args(approx_rank=1), opt(0, False, False), None),
        ("biases compressed", _args(approx_rank=12, min_compression_rate=0.5), opt(), None),
        ("shapes apart", _args(), opt(), _problem(widths=(16, 24, 16, 24, 8))),
        ("ell past the rank", _args(global_batch=4, approx_rank=8, min_compression_rate=1.0), opt(), None),
        ("zero gradient", _args(), opt(), _problem(zero_inputs=True)),
        ("zero gradient, epsilon", _args(), opt(orthogonalization_epsilon=1e-8), _problem(zero_inputs=True)),
        ("zero gradient, QR", _args(approx_rank=4), opt(), _problem(zero_inputs=True)),
    ]


def _train_cases(rt):
    """Every case's parameters by hand and by torch, and the Gram-Schmidt-only twin where ell passes the rank."""
    lesson = load_lesson("powersgd")
    right, out = lesson.make_problem, {}
    for name, args, options, problem in _cases():
        lesson.make_problem = problem or right
        try:
            hooks = {"by hand": lesson.powersgd_hook, "torch": "torch"}
            if name == "ell past the rank":
                hooks["Gram-Schmidt only"] = _wrong(_gram_schmidt_only, lesson.powersgd_hook)
            out[name] = {k: lesson.train_ddp(rt, args, h, args.approx_rank, options)[0] for k, h in hooks.items()}
        finally:
            lesson.make_problem = right
    return out


def _train(rt, args, kinds):
    """Each kind of run on this rank: its parameters after --steps (and, but for the wrong hooks, the by-hand
    hook's ledger); at P = 2 also ell = 4 and every case of torch's options."""
    lesson = load_lesson("powersgd")
    out = {}
    if rt.world_size == 2:
        hooks = {"by hand": lesson.powersgd_hook, "torch": "torch"}
        out["ell 4"] = {k: lesson.train_ddp(rt, _args(approx_rank=4), h, 4)[0] for k, h in hooks.items()}
        out["cases"] = _train_cases(rt)
    for kind in kinds:
        if kind in WRONG:
            out[kind] = lesson.train_ddp(rt, args, _wrong(WRONG[kind], lesson.powersgd_hook), args.approx_rank)[0]
            continue
        hook = lesson.powersgd_hook if kind == "by hand" else kind
        params, _, ledger = lesson.train_ddp(rt, args, hook, args.approx_rank)
        out[kind] = (params, dict(ledger.sent_by))
    return out


@pytest.fixture(scope="module")
def runs():
    every = {}
    for world in (1, 2, 3, 4):
        kinds = ("by hand", "torch", "none", *WRONG) if world == 2 else ("by hand", "torch")
        every[world, 2] = spawn(_train, world, _args(), kinds)[0]
    every[2, 4], every["cases"] = every[2, 2].pop("ell 4"), every[2, 2].pop("cases")
    return every


def _diff(a, b) -> float:
    return max((u - v).abs().max().item() for u, v in zip(a, b))


def _one_process(world, ell):
    lesson = load_lesson("powersgd")
    args = _args(approx_rank=ell)
    model, batch = lesson.make_problem(args)
    return lesson.one_process(model, batch, args, world, ell)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_by_hand_equals_torchs_hook_and_one_process(runs, world):
    mine, theirs = runs[world, 2]["by hand"][0], runs[world, 2]["torch"][0]
    assert _diff(mine, theirs) == 0.0  # ell = 2: both Gram-Schmidt, the same sums in the same order
    alone = _one_process(world, 2)
    if world <= 2:
        assert _diff(mine, alone) == 0.0
    else:
        assert _diff(mine, alone) < 1e-12


def test_rank_four_against_torchs_qr_and_one_process(runs):
    mine, theirs = runs[2, 4]["by hand"], runs[2, 4]["torch"]
    assert _diff(mine, theirs) == 0.0
    assert _diff(mine, _one_process(2, 4)) == 0.0


@pytest.mark.parametrize(
    "case",
    ["no error feedback", "cold start, QR", "start at 4", "epsilon", "start at 0, stateless", "biases compressed"]
    + ["shapes apart", "ell past the rank", "zero gradient, epsilon", "zero gradient, QR"],
)
def test_by_hand_equals_torchs_hook_with_its_options(runs, case):
    got = runs["cases"][case]
    assert all(torch.isfinite(t).all() for t in got["by hand"])
    assert _diff(got["by hand"], got["torch"]) == 0.0


def test_options_change_the_result(runs):
    """Each option really acts: every case differs from the default run at its ell."""
    default = runs[2, 2]["by hand"][0]
    for case, by in (("no error feedback", 1e-8), ("start at 4", 1e-8), ("epsilon", 0.0)):  # 1e-8 on norms ~1
        assert _diff(runs["cases"][case]["by hand"], default) > by, case
    assert _diff(runs["cases"]["cold start, QR"]["by hand"], runs[2, 4]["by hand"]) > 1e-8


def test_gram_schmidt_past_the_rank_is_off_where_qr_is_not(runs):
    """ell = 8 on a batch of 4 rows: Gram-Schmidt's trailing columns are rounding noise; torch's QR and ours agree."""
    got = runs["cases"]["ell past the rank"]
    assert _diff(got["Gram-Schmidt only"], got["torch"]) > 1e-6


def test_a_zero_gradient_gives_nan_in_both_without_epsilon(runs):
    """0/0 in Gram-Schmidt (torch's except ZeroDivisionError never fires): NaN everywhere in both."""
    got = runs["cases"]["zero gradient"]
    assert all(torch.isnan(t).all() for t in got["by hand"] + got["torch"])
    start = next(load_lesson("powersgd").make_problem(_args())[0].parameters())  # the first layer's weight
    for case in ("zero gradient, epsilon", "zero gradient, QR"):  # its gradient stays zero: the weight unmoved
        assert torch.equal(runs["cases"][case]["by hand"][0], start.detach()), case


def test_compression_really_happens(runs):
    """Differs from uncompressed DDP by far more than rounding; the plain run equals one process's mean."""
    mine, plain = runs[2, 2]["by hand"][0], runs[2, 2]["none"][0]
    assert _diff(mine, plain) > 1e-4
    assert _diff(plain, _one_process(2, None)) < 1e-12


@pytest.mark.parametrize("wrong", list(WRONG))
def test_the_checks_fail_on_a_wrong_hook(runs, wrong):
    got, torch_run = runs[2, 2][wrong], runs[2, 2]["torch"][0]
    assert _diff(got, torch_run) > 1e-8 and _diff(got, _one_process(2, 2)) > 1e-8


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_bytes_handed_to_the_all_reduces_equal_the_formula(runs, world):
    """Widths 16 -> 24 -> 24 -> 8 at ell = 2, rate 2: the 24 x 16 and 24 x 24 weights go as (n + m) ell; the 8 x 24
    one too ((8 + 24) 2 x 2 = 128 < 192); the biases whole."""
    sent = runs[world, 2]["by hand"][1]
    compressed = (24 + 16) * 2 + (24 + 24) * 2 + (8 + 24) * 2
    whole = 24 + 24 + 8
    everything = 24 * 16 + 24 + 24 * 24 + 24 + 8 * 24 + 8
    assert sent["plain", "all_reduce"] == 8 * everything * 2  # the first two steps, the whole bucket
    assert sent["whole", "all_reduce"] == 8 * whole * (STEPS - 2)
    assert sent["U", "all_reduce"] + sent["V", "all_reduce"] == 8 * compressed * (STEPS - 2)
    assert sent["U", "all_reduce"] == 8 * (24 + 24 + 8) * 2 * (STEPS - 2)  # sum n ell


def test_same_shaped_matrices_are_taken_together_as_torch_does():
    """The bucket of widths 16, 24, 16, 24, 8 (last layer first): the two 24 x 16 weights are taken side by side."""
    assert load_lesson("powersgd").by_shape([(8, 24), (24, 16), (16, 24), (24, 16)]) == [0, 1, 3, 2]


def test_which_matrices_are_compressed():
    lesson = load_lesson("powersgd")
    assert lesson.compressed_rank(torch.Size([8, 64]), 2, 2.0) == 2  # 144 x 2 < 512
    assert lesson.compressed_rank(torch.Size([8, 64]), 4, 2.0) == 0  # 288 x 2 >= 512: sent whole
    assert lesson.compressed_rank(torch.Size([64]), 1, 2.0) == 0  # a vector, 64 x 1: sent whole at rate >= 1
    assert lesson.compressed_rank(torch.Size([64]), 3, 0.5) == 1  # ... and at rank 1 when 65 x 0.5 < 64
    assert lesson.compressed_rank(torch.Size([3, 64]), 8, 1.0) == 0  # ell capped at 3: 201 >= 192
    assert lesson.compressed_rank(torch.Size([4, 4, 3, 3]), 1, 2.0) == 1  # a conv kernel as 4 x 36


@pytest.mark.parametrize("ell", [1, 2, 4])
def test_orthonormalise(ell):
    """Orthonormal columns, the same bits as torch's _orthogonalize (Gram-Schmidt at ell <= 2, QR above)."""
    lesson = load_lesson("powersgd")
    a = torch.randn(40, ell, dtype=torch.float64, generator=torch.Generator().manual_seed(ell))
    mine, theirs = a.clone(), a.clone().unsqueeze(0)
    lesson.orthonormalise(mine)
    assert torch.allclose(mine.T @ mine, torch.eye(ell, dtype=torch.float64), atol=1e-12)
    torch_powersgd._orthogonalize(theirs)
    assert torch.equal(mine, theirs[0])


def _rules(rt, ell):
    load_lesson("powersgd").world_rules(_args(approx_rank=ell, width=64, layers=3, global_batch=48), rt.world_size)


def test_a_rank_larger_than_the_matrix_is_refused_on_every_rank():
    message = assert_same_error_on_every_rank(_rules, 2, 9, match="--approx-rank")
    assert "ell = 9" in message and "min(n, m) = 8" in message and "\n" not in message
    assert_flag_refused("powersgd", "--approx-rank", "--approx-rank", "0")


def test_the_lesson_passes():
    out = assert_lesson_passes_at_80_columns("powersgd", 2, "--steps", "6", "--width", "32")
    assert "vs torch's hook" in out and "(n + m) ell" in out and "step 6" in out
