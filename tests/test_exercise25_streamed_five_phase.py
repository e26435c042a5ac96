"""Exercise 25: the streamed five-phase step, judged on P = 2 ranks with dropout on and a learned scale.

The reference is plain autograd on the whole global batch in each rank's process (a deep copy), each rank's
micro-batches replayed from its own random stream (`as_ranks` with the step's own cut, cfg.micro). The
lesson's claims: the loss equals the reference's; the gradient reaching this rank's embeddings in its
recompute is P dL/dz for its rows (the judge reads it off the model's outputs); every parameter's gradient
equals the reference's, the logit scale's included (float64, rtol 1e-10), with micro-batches (4, 3) and
tiles of 5 that divide nothing; and beyond numbers: no tensor N x N, C x N or B x N (the judge sees every
allocation's shape), and DDP reduces in one backward per step (a comm hook counts them)."""

import contextlib
import copy
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from exercise_kit import Exercise, solution, swapped
from exercise_signatures import Mistake, Scaled, Tensors, all_but
from exercise_watch import Watch, spanning
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distlab.contrastive.reference import RankStreams, as_ranks, full_batch_gradients
from distlab.data_split.data_parallel.ddp import counting
from distlab.proof.compare import grads_of
from distlab.proof.models import TwoTower, paired_data
from distlab.streamed.config import parse_config

LESSON, NAME = "streamed_five_phase", "streamed_backward"
P, SEED, N, B, T = 2, 5, 14, 4, 5  # C = 7: micro-batches (4, 3); d = 8 and 2d = 16 collide with no batch size
CONFIG = {"GLOBAL_BATCH_SIZE": N, "MICRO_BATCH_SIZE": B, "STREAM_CHUNK_SIZE": T}
SOLUTION = solution(LESSON, NAME)


class ScaledTowers(TwoTower):
    """Two towers with dropout and a learned logit scale returned third (open_clip's way)."""

    def __init__(self):
        super().__init__(dropout=0.3, seed=1, dtype=torch.float64)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(10.0), dtype=torch.float64))

    def forward(self, x, y):
        return (*super().forward(x, y), self.logit_scale.exp())


def _embedding_grads(model: nn.Module) -> dict[str, list]:
    """The gradient reaching z_x, z_y and s of every forward the model runs with a graph, in order."""
    grads = {"z_x": [], "z_y": [], "s": []}

    def keep(name: str, slot: int):
        return lambda g: grads[name].__setitem__(slot, g.detach().clone())

    def hook(module, inputs, outputs):
        if torch.is_grad_enabled():
            for name, z in zip(grads, outputs[:3]):
                grads[name].append(None)
                z.register_hook(keep(name, len(grads[name]) - 1))

    model.register_forward_hook(hook)
    return grads


def _reference(start: nn.Module, x, y, cfg) -> tuple[float, dict, dict]:
    """(L, dL/dtheta, dL/dZ) of plain autograd on the whole batch, every rank's dropout replayed."""
    streams, outputs = RankStreams([SEED + r for r in range(P)]), {}

    def forward(model, x, y):
        z_x, z_y, s = as_ranks(streams, cfg.micro)(model, x, y)
        for name, z in (("z_x", z_x), ("z_y", z_y)):
            z.retain_grad()
            outputs[name] = z
        return z_x, z_y, s

    loss, grads = full_batch_gradients(start, x, y, None, forward=forward)
    return loss, grads, {name: z.grad for name, z in outputs.items()}


def _ranks(rt, streamed_backward, claims) -> None:
    cfg, model = parse_config(CONFIG, rt.world_size, rt.rank), ScaledTowers()
    x, y = paired_data(cfg.n, seed=2, dtype=torch.float64)
    start, ddp, mine = copy.deepcopy(model), DDP(model), slice(cfg.offset, cfg.offset + cfg.local)
    reducing, arrived = counting(ddp), _embedding_grads(model)
    torch.manual_seed(SEED + rt.rank)  # each rank its own dropout stream
    with Watch() as watch:
        loss = streamed_backward(ddp, x[mine], y[mine], cfg, None)
    ref_loss, ref, ref_z = _reference(start, x, y, cfg)
    claims.equal(
        "the loss equals the whole batch's",
        float(loss),
        ref_loss,
        ok=math.isclose(float(loss), ref_loss, rel_tol=1e-10),
        what="L",
    )
    for name in ("z_x", "z_y"):
        got = [g for g in arrived[name] if g is not None]
        claims.close(
            f"the gradient reaching {name} in the recompute is P dL/d{name} on my rows",
            torch.cat(got) if got else None,
            P * ref_z[name][mine],
            what=f"dL/d{name} x P",
        )
    s = start.logit_scale.exp().item()
    reached = [g for g in arrived["s"] if g is not None]
    total = torch.stack(reached).sum() if reached else torch.zeros((), dtype=torch.float64)
    dist.all_reduce(total)  # every rank's share of dL/ds, as DDP's reduction adds them
    want = P * ref["logit_scale"] / s  # logit_scale's gradient is s dL/ds
    claims.close(
        "the gradient reaching s, over the recomputes and the ranks, is P dL/ds",
        total,
        want,
        what="dL/ds x P",
        note=_reaching_s(total, want, s) + _others(grads_of(model), ref),
        hints=("S_ij = s z_i^x . z_j^y, so dL/ds = sum_ij dL/dS_ij S_ij / s = (1/s) sum_i z_i^x . G_x,i",),
    )
    mine_flat = torch.cat([g.flatten() for g in grads_of(model).values() if g is not None])
    every = [torch.empty_like(mine_flat) for _ in range(rt.world_size)]
    dist.all_gather(every, mine_flat)  # DDP leaves every rank the same gradients, whatever they are
    claims.holds(
        "every rank ends with the same gradients (DDP reduced every part of them)",
        all(torch.allclose(e, mine_flat, rtol=1e-12, atol=0) for e in every),
        what="the gradients across ranks",
        hints=(
            "the ranks disagree: part of each rank's gradient was added after DDP's reduction, on that rank alone",
            "DDP reduces in the one backward outside no_sync(): that must be the last micro-batch's, after every "
            "other micro-batch's gradient is in .grad",
            "with ddp.no_sync() if k < len(micro) - 1 else nullcontext(): the recompute and its backward",
        ),
    )
    claims.tensors("every parameter's gradient equals the whole batch's", grads_of(model), ref, what="the gradients")
    claims.equal(
        "no tensor is N x N, C x N or B x N",
        spanning(watch.shapes, N, {N, cfg.local, *{r.stop - r.start for r in cfg.micro}}),
        [],
        what="tensors that span the batch twice",
        hints=("only T x T tiles of S may exist: stream the log-sum-exps and the gradient tile by tile",),
    )
    claims.equal(
        "DDP all-reduces in one backward per step",
        reducing.backwards,
        1,
        what="backwards that all-reduced",
        hints=("every micro-batch's backward but the last belongs inside ddp.no_sync()",),
    )


def _reaching_s(got: torch.Tensor, want: torch.Tensor, s: float) -> str:
    """What reached s against P dL/ds, in the scale s itself: "100 x P dL/ds (= s^2 at s = 10)", or none."""
    if not got.abs().max() > 0:
        return "no gradient reached s in any recompute"
    k = (got / want).item()
    forms = {"s^2": s * s, "s": s, "1/s": 1 / s, "1/s^2": 1 / (s * s), "-1": -1.0}
    named = next((f" (= {f} at s = {s:.6g})" for f, v in forms.items() if math.isclose(k, v, rel_tol=1e-9)), "")
    return f"the gradient that reached s is {k:.6g} x P dL/ds{named}"


def _others(got: dict, want: dict) -> str:
    """ "; every other parameter's gradient is right" when only logit_scale's may be wrong."""
    others = [n for n in want if n != "logit_scale"]
    right = all(got.get(n) is not None and torch.allclose(got[n], want[n], rtol=1e-10, atol=0) for n in others)
    return "; every other parameter's gradient is right" if right else ""


@dataclass(frozen=True)
class NoGradient:
    """The 0-dim parameter `name` missed with no factor to its reference: it got no gradient (zero or None)."""

    name: str

    def match(self, failing: dict, world: int) -> str | None:
        if all(dict(s.ratios).get(self.name, 1.0) is None for s in failing.values()):
            return f"{self.name}'s gradient is zero: it got none"
        return None


MISTAKES = (
    Mistake(
        "the VJP without the factor P",
        "reaching z_x",
        (Scaled("1/P", lambda p: 1 / p),),
        (
            "DDP averages the ranks' gradients, but dL/dtheta is their sum",
            "back-propagate P times G through each recompute, so DDP's average of the P ranks is the sum",
            "torch.autograd.backward(out, [cfg.world * g for g in (g_x, g_y, g_s)])",
        ),
    ),
    Mistake(
        "1/N where the loss has 1/(2N)",
        "reaching z_x",
        (Scaled("2", lambda p: 2),),
        (
            "the symmetric loss averages two directions over N rows",
            "L = 1/(2N) sum_i (a_i + b_i - 2 S_ii): G carries s/(2N)",
            "g_x = s / (2 * n) * (the tiles' sum), and the same for g_y",
        ),
    ),
    Mistake(
        "delta_ij on local indices",
        "reaching z_x",
        (all_but(0),),
        (
            "rank 0 is right and the others are not: what does rank 0 have that they lack?",
            "delta_ij = 1 where row i meets its positive: i and j are both global indices, row i = offset + local i",
            "compare the tile's global rows cfg.offset + rows.start + ... with its global columns",
        ),
    ),
    Mistake(
        "the random state not replayed",
        "every parameter",
        (Tensors(("logit_scale",), but=True),),
        (
            "G is right; the parameters' gradient is not: the recompute is not the forward G was computed for",
            "dropout draws new masks in the recompute unless the micro-batch's random state is restored",
            "record RandContext(x_k, y_k) before each phase-1 forward and run the recompute inside `with state:`",
        ),
        holds=("the loss equals", "reaching z_x", "reaching z_y"),
    ),
    Mistake(
        "the logit scale gets no gradient",
        "every parameter",
        (Tensors(("logit_scale",)), NoGradient("logit_scale")),
        (
            "s is a parameter too: L depends on it through every S_ij",
            "dL/ds = (1/s) sum_i z_i^x . G_x,i over this rank's rows; back-propagate it with the embeddings",
            "torch.autograd.backward((z_x, z_y, s), [P * g_x, P * g_y, P * g_s])",
        ),
    ),
)


def _tiles(scale):
    """The lesson's grad_by_tiles with every result multiplied by `scale(offset)`-style changes."""
    real = SOLUTION.module().grad_by_tiles
    return lambda q, k, lse_q, lse_k, s, t, offset: scale * real(q, k, lse_q, lse_k, s, t, offset)


def without_p(ddp, local_x, local_y, cfg, tau):
    """G_x, G_y and dL/ds back-propagated without the factor P (each a P-th of what it should be)."""
    with swapped(SOLUTION, grad_by_tiles=_tiles(1 / cfg.world)):
        return SOLUTION.load()(ddp, local_x, local_y, cfg, tau)


def one_over_n(ddp, local_x, local_y, cfg, tau):
    """G carries s/N instead of s/(2N)."""
    with swapped(SOLUTION, grad_by_tiles=_tiles(2)):
        return SOLUTION.load()(ddp, local_x, local_y, cfg, tau)


def local_delta(ddp, local_x, local_y, cfg, tau):
    """delta_ij with the rows counted from this rank's first row, the columns from the batch's."""
    real = SOLUTION.module().grad_by_tiles
    local = lambda q, k, lse_q, lse_k, s, t, offset: real(q, k, lse_q, lse_k, s, t, offset - cfg.offset)  # noqa: E731
    with swapped(SOLUTION, grad_by_tiles=local):
        return SOLUTION.load()(ddp, local_x, local_y, cfg, tau)


class _Forgets(contextlib.nullcontext):
    """A random state that restores nothing."""

    def __init__(self, *tensors):
        super().__init__()


def no_replay(ddp, local_x, local_y, cfg, tau):
    """The recompute draws new dropout masks."""
    with swapped(SOLUTION, RandContext=_Forgets):
        return SOLUTION.load()(ddp, local_x, local_y, cfg, tau)


def scale_left_out(ddp, local_x, local_y, cfg, tau):
    """Every gradient but the logit scale's (back-propagated as if s were a constant)."""
    loss = SOLUTION.load()(ddp, local_x, local_y, cfg, tau)
    ddp.module.logit_scale.grad.zero_()
    return loss


def whole_logits(ddp, local_x, local_y, cfg, tau):
    """Right numbers, the whole N x N S built for phase 2's a and b."""
    with swapped(SOLUTION, lse_by_tiles=lambda q, k, s, t: (s * q @ k.T).logsumexp(1)):
        return SOLUTION.load()(ddp, local_x, local_y, cfg, tau)


def without_no_sync(ddp, local_x, local_y, cfg, tau):
    """Right numbers (averaging is linear), but DDP all-reduces after every micro-batch's backward."""
    ddp.no_sync = contextlib.nullcontext
    return SOLUTION.load()(ddp, local_x, local_y, cfg, tau)


# World sizes: P = 2 only: the VJP's factor P and 1/(2N) are apart at N = 14; a third rank adds a run, not a claim
# that reads otherwise.
EXERCISE = Exercise(
    LESSON,
    NAME,
    _ranks,
    P,
    MISTAKES,
    hints=(
        "GradCache's cache G = dL/dz, computed without ever holding a row of S: two streaming passes over tiles",
        "phase 1 no-grad forward and gather; phase 2 a and b by an online log-sum-exp over T x T tiles; per "
        "micro-batch G from the tiles, the recompute under its saved random state, backward of P <out, G>",
        "a_i = online_fold over tiles of s z_x[rows] z_y[cols]^T; G_x,i = s/(2N) sum_j (exp(S_ij - a_i) + "
        "exp(S_ij - b_j) - 2 delta_ij) z_j^y; torch.autograd.backward(out, [P g_x, P g_y, P g_s])",
    ),
    numbers="loss|gradient",
    quantities=lambda p: {"N": N, "C": N // p, "B": B, "chunk": T},
)
WRONG = {
    "the VJP without the factor P": "without_p",
    "1/N where the loss has 1/(2N)": "one_over_n",
    "delta_ij on local indices": "local_delta",
    "the random state not replayed": "no_replay",
    "the logit scale gets no gradient": "scale_left_out",
}
test_exercise, test_the_blank_is_not_written_yet, test_the_judge_names_the_mistake = EXERCISE.tests(
    Path(__file__), WRONG
)
test_the_judge_checks_beyond_numbers = EXERCISE.structure_test(
    Path(__file__), {"whole_logits": "N x N", "without_no_sync": "one backward per step"}
)

test_the_judge_rejects_a_planted_slip = EXERCISE.audit_test(Path(__file__))
test_the_judge_rejects_a_second_slip = EXERCISE.audit_test(Path(__file__), second=True)
