"""Lesson 17: PowerSGD, gradients all-reduced as low-rank factors, by hand as a DDP communication hook, proven
equal to torch's `powerSGD_hook` and to the same algebra in one process.

    torchrun --nproc-per-node 2 lessons/17_powersgd.py     # any P that divides N (48: P = 1..4)

Data parallelism (lesson 06) all-reduces every gradient: 2(P-1)/P x e n m bytes per rank for an n x m weight
(e bytes per element). PowerSGD (Vogels et al. 2019, https://arxiv.org/abs/1905.13727) sends two thin factors
instead (the paper's P and Q; here U and V, since P is the world size and Q a softmax). Rank r holds its
gradient G_r, adds the error it kept last step, M_r = G_r + Delta_r, and with V an m x ell matrix of
orthonormal columns (ell the rank of the approximation, ell << n, m; `--approx-rank`):

    1. U_r = M_r V                      n x ell            all-reduce:  U = sum_r U_r = (sum_r M_r) V
    2. U <- orthonormal columns of U    (Gram-Schmidt, below; no communication)
    3. V_r = M_r^T U                    m x ell            all-reduce:  V = (1/P) sum_r V_r = Mbar^T U
    4. the gradient every rank uses:    U V^T = U U^T Mbar, the mean Mbar projected on ell directions
    5. error feedback:                  Delta_r <- M_r - U V^T, what this rank's share lost, added back next step

One step of the power iteration per training step: V is kept from the last step (warm start) and
re-orthonormalised, so over steps it tracks Mbar's top-ell right singular vectors at the price of one matmul
pair. Bytes: (n + m) ell elements instead of n m. Every gradient is viewed as an n x m matrix, a vector of n
(a bias) as n x 1 at ell = 1; one for which that saves too little (torch's `min_compression_rate`: compress when
(n + m) ell x rate < n m; a bias never at rate >= 1, always at rate < n / (n + 1)) is all-reduced whole, and
the error feedback covers it too: Delta_r <- M_r - mean, zero in sum over the ranks.

Every step is linear in the sum over ranks except the orthonormalisation, which acts on the summed U: so the
result depends on the ranks' gradients only through their mean, and equals one process running the same
algebra on the P shares: bit for bit at P <= 2 (a sum of two numbers is the same in either order), to 1e-12
at P >= 3 (gloo's ring adds in another order). DDP rebuilds its buckets after its first step, so the hook
all-reduces plainly for the first START_ITER steps (torch refuses fewer than 2 with warm start or error feedback).

The hook below (`powersgd_hook`) runs under torch's DDP (`register_comm_hook`): DDP hands it one bucket of
gradients at a time, the flat buffer and views of each parameter's gradient in it, and takes back the
buffer it should write into the parameters' .grad. Its twin is torch's
`torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook`, with its options by its names (`Options`: error
feedback, warm start, the start iteration, the orthogonalisation epsilon), and the two agree bit for bit at
every ell. Like torch, the hook orthonormalises by Gram-Schmidt at ell <= 2 and by Householder QR (LAPACK)
above: Gram-Schmidt is not stable. When ell exceeds the rank of M V (a batch of fewer rows than ell, a
matrix whose gradient has lower rank), its trailing columns are rounding noise, no longer orthogonal to the
others, and U U^T Mbar is not Mbar's projection: Gram-Schmidt at ell = 8 on 4 rows is 3e-4 from QR after 8
steps. Both hooks share that weakness at ell <= 2: a matrix whose M is zero gives 0/0, NaN in its gradient
and, through the next steps, in every parameter (torch's `except ZeroDivisionError` never fires: a tensor
divided by zero is NaN, not an error); torch's cure is orthogonalization_epsilon (1e-8: a zero column stays
zero), QR gives a zero gradient. What compression costs is measured, not bounded: the loss after a few steps
at ell = 1, 2, 4 beside uncompressed DDP.
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations, as types, at registration.
import copy
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd
from torch.nn.parallel import DistributedDataParallel as DDP

from distlab.comm.ledger import Ledger
from distlab.processes.console import print0, rows_table
from distlab.processes.flags import (
    check_flags_against_world,
    divides_global_batch,
    positive_float,
    positive_int,
    require,
)
from distlab.processes.identity import Runtime
from distlab.processes.runtime import distributed, run_main
from distlab.proof.cli import add_optimizer_args, lesson_parser
from distlab.proof.models import layered_mlp, regression_batch
from distlab.proof.verdict import Verdict

START_ITER = 2  # plain all-reduces first: DDP rebuilds its buckets after step 1 (torch's start_powerSGD_iter)
IN_FEATURES, OUT_FEATURES = 16, 8
RANKS_SHOWN = (1, 2, 4)  # the loss table's ell, with --approx-rank added

# ---- the mechanism: the low-rank all-reduce as a DDP communication hook -----------------------------------


@dataclass
class Options:
    """torch's PowerSGDState options, by its names and with its defaults but the start (2, torch's least)."""

    start_powerSGD_iter: int = START_ITER  # plain all-reduces before it
    use_error_feedback: bool = True  # Delta_r kept and added back
    warm_start: bool = True  # V kept from the last step; else drawn afresh every step
    orthogonalization_epsilon: float = 0.0  # Gram-Schmidt divides by norm + epsilon


def orthonormalise(columns: torch.Tensor, epsilon: float = 0.0) -> None:
    """In place on an n x ell matrix, as torch's hook does. ell <= 2: Gram-Schmidt, column i divided by its
    norm (+ epsilon), then its component removed from every later column j: a_j <- a_j - (a_i . a_j) a_i.
    ell > 2: Householder QR's Q, orthonormal even when the columns are nearly dependent (the docstring).
    (torch's Gram-Schmidt removes column i from all later ones in one vectorised sum: the same numbers.)"""
    ell = columns.shape[1]
    if ell > 2:
        columns.copy_(torch.linalg.qr(columns).Q)
        return
    for i in range(ell):
        col = columns[:, i]
        col /= torch.norm(col) + epsilon
        for j in range(i + 1, ell):
            later = columns[:, j]
            later -= torch.sum(col * later) * col


def compressed_rank(shape: torch.Size, ell: int, min_compression_rate: float) -> int:
    """The rank a gradient of this shape is sent at, viewed as n x m (a vector as n x 1): 0 when it goes whole
    ((n + m) ell x rate not below n m), else min(n, m, ell)."""
    n, m = shape[0], shape[1:].numel()
    ell = min(n, m, ell)
    return ell if (n + m) * ell * min_compression_rate < n * m else 0


def by_shape(shapes: list) -> list[int]:
    """The order torch's hook takes the compressed matrices in (and so lays out U, V and draws the first V's):
    grouped by shape, the groups in order of first appearance, each group in bucket order."""
    first: dict = {}
    for i, shape in enumerate(shapes):
        first.setdefault(tuple(shape), i)
    return sorted(range(len(shapes)), key=lambda i: first[tuple(shapes[i])])


class LowRankState:
    """What the hook keeps between steps, per bucket: the error Delta_r, the warm-started V's (one flat buffer),
    the step count; and the bytes it handed to each all-reduce (`ledger`, phases "plain", "whole", "U", "V")."""

    def __init__(self, ell: int, min_compression_rate: float = 2.0, seed: int = 0, group=None, options=None):
        self.ell, self.min_compression_rate, self.group = ell, min_compression_rate, group
        self.options = options or Options()
        self.rng = np.random.RandomState(seed)  # draws one seed per bucket for its first V (as torch's state does)
        self.step, self.errors, self.vs = 0, {}, {}
        self.ledger = Ledger()

    def all_reduce(self, flat: torch.Tensor, phase: str) -> None:
        self.ledger.add(phase, "all_reduce", flat.numel() * flat.element_size())  # payload; a ring sends 2(P-1)/P
        dist.all_reduce(flat, group=self.group)

    def bucket_done(self, bucket: dist.GradBucket) -> None:
        self.step += bucket.is_last()  # a training step ends with its last bucket


def views(flat: torch.Tensor, shapes: list[tuple[int, int]]) -> list[torch.Tensor]:
    """Consecutive matrices of the given shapes inside one flat buffer (one all-reduce carries them all)."""
    out, start = [], 0
    for rows, cols in shapes:
        out.append(flat[start : start + rows * cols].view(rows, cols))
        start += rows * cols
    return out


def product(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """a b, computed as torch's hook computes it: `bmm` on a batch of one. On the CPU, for small matrices, bmm
    and mm add the products in different orders: the same numbers to rounding, not bit for bit."""
    return torch.bmm(a[None], b[None], out=None if out is None else out[None])[0]


def done(flat: torch.Tensor) -> torch.futures.Future:
    future = torch.futures.Future()
    future.set_result(flat)
    return future


def powersgd_hook(state: LowRankState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's all-reduce of one bucket replaced by PowerSGD's: the buffer ends holding, in each matrix's place,
    U V^T (compressed) or the mean (sent whole). Every rank ends with the same buffer."""
    flat, world, opts = bucket.buffer(), dist.get_world_size(state.group), state.options
    if state.step < opts.start_powerSGD_iter:  # the plain mean, (1/P) sum_p G_p
        flat.div_(world)
        state.all_reduce(flat, "plain")
        state.bucket_done(bucket)
        return done(flat)
    index = bucket.index()
    if opts.use_error_feedback:
        flat.add_(state.errors.setdefault(index, torch.zeros_like(flat)))  # M_r = G_r + Delta_r, the whole bucket
    before = flat.clone()
    grads = bucket.gradients()  # views into `flat`: writing them writes the buffer DDP returns
    rhos = [compressed_rank(g.shape, state.ell, state.min_compression_rate) for g in grads]
    whole = [g for g, ell in zip(grads, rhos) if ell == 0]
    mats = [g.view(g.shape[0], -1) for g, ell in zip(grads, rhos) if ell > 0]
    rhos = [ell for ell in rhos if ell > 0]
    order = by_shape([m.shape for m in mats])
    mats, rhos = [mats[i] for i in order], [rhos[i] for i in order]
    # the tensors sent whole: one all-reduce of their concatenation, then the mean back in place
    packed = torch.cat([g.view(-1) for g in whole]) if whole else flat.new_empty(0)
    state.all_reduce(packed, "whole")
    packed.div_(world)
    for g, mean in zip(whole, packed.split([g.numel() for g in whole])):
        g.copy_(mean.view_as(g))
    if index not in state.vs or not opts.warm_start:  # V drawn from N(0, 1), seeded alike on every rank
        state.vs[index] = flat.new_empty(sum(m.shape[1] * ell for m, ell in zip(mats, rhos)))
        gen = torch.Generator().manual_seed(int(state.rng.randint(1_000_000_000)))
        for v in views(state.vs[index], [(m.shape[1], ell) for m, ell in zip(mats, rhos)]):
            v.copy_(torch.randn(*v.shape, generator=gen, dtype=v.dtype))
    vs = views(state.vs[index], [(m.shape[1], ell) for m, ell in zip(mats, rhos)])
    for v in vs:
        orthonormalise(v, opts.orthogonalization_epsilon)  # warm start: last step's V, re-orthonormalised
    u_flat = flat.new_empty(sum(m.shape[0] * ell for m, ell in zip(mats, rhos)))
    us = views(u_flat, [(m.shape[0], ell) for m, ell in zip(mats, rhos)])
    for m, v, u in zip(mats, vs, us):
        product(m, v, out=u)  # 1. U_r = M_r V
    state.all_reduce(u_flat, "U")  # sum_r M_r V: no 1/P, the orthonormalisation forgets the scale
    for u in us:
        orthonormalise(u, opts.orthogonalization_epsilon)  # 2.
    for m, u, v in zip(mats, us, vs):
        product(m.t(), u, out=v)  # 3. V_r = M_r^T U
    state.all_reduce(state.vs[index], "V")
    state.vs[index].div_(world)  # V = Mbar^T U, kept for the next step
    for m, u, v in zip(mats, us, vs):
        product(u, v.t(), out=m)  # 4. U V^T, written into the bucket
    if opts.use_error_feedback:
        state.errors[index] = before - flat  # 5. Delta_r = M_r - what every rank now uses
    state.bucket_done(bucket)
    return done(flat)


# ---- the reference: the same algebra in one process, on the P shares of the batch -------------------------


def one_process(model: nn.Module, batch, args, world: int, ell: int | None) -> list[torch.Tensor]:
    """The parameters after --steps SGD steps of a deep copy, each step's gradient formed in this one
    process from the P ranks' gradients (plain autograd on each rank's rows), mean, or (ell given) the
    low-rank algebra of the docstring. DDP's one bucket lists the gradients last layer first: so are the
    first V's drawn."""
    model = copy.deepcopy(model)
    params = list(model.parameters())
    shares = [[t.chunk(world)[r] for t in batch] for r in range(world)]
    errors = [[torch.zeros_like(t) for t in params] for _ in range(world)]
    rng, vs = np.random.RandomState(args.seed), {}
    optimizer = torch.optim.SGD(params, lr=args.lr)  # torch's SGD, as under DDP: p + (-lr) g, one rounding
    for step in range(args.steps):
        local = [torch.autograd.grad(F.mse_loss(model(x), y), params) for x, y in shares]
        if ell is None or step < START_ITER:
            grads = [sum(g[k] / world for g in local) for k in range(len(params))]
        else:
            grads = reference_step(local, errors, vs, rng, ell, args.min_compression_rate)
        for t, g in zip(params, grads):
            t.grad = g
        optimizer.step()
    return [t.detach() for t in params]


def gram_schmidt(a: torch.Tensor) -> None:
    """The reference's orthonormalisation (the arithmetic of `orthonormalise`, on a plain matrix)."""
    if a.shape[1] > 2:
        a.copy_(torch.linalg.qr(a).Q)
        return
    for i in range(a.shape[1]):
        a[:, i] /= a[:, i].norm()
        for j in range(i + 1, a.shape[1]):
            a[:, j] -= (a[:, i] * a[:, j]).sum() * a[:, i]


def reference_step(local, errors, vs: dict, rng, ell: int, rate: float) -> list[torch.Tensor]:
    """One compressed step, parameter by parameter; `errors[r][k]` and `vs[k]` carried between steps."""
    world, count = len(local), len(local[0])
    ms = [[(local[r][k] + errors[r][k]).view(local[r][k].shape[0], -1) for k in range(count)] for r in range(world)]
    order = [k for k in reversed(range(count)) if compressed_rank(local[0][k].shape, ell, rate)]
    order = [order[i] for i in by_shape([ms[0][k].shape for k in order])]
    if not vs:
        gen = torch.Generator().manual_seed(int(rng.randint(1_000_000_000)))
        for k in order:
            n, m = ms[0][k].shape
            vs[k] = torch.randn(m, min(n, m, ell), generator=gen, dtype=ms[0][k].dtype)
    grads = []
    for k in range(count):
        if k not in vs:
            grads.append(sum(ms[r][k] for r in range(world)) / world)
            continue
        gram_schmidt(vs[k])
        u = sum(product(ms[r][k], vs[k]) for r in range(world))
        gram_schmidt(u)
        vs[k] = sum(product(ms[r][k].t(), u) for r in range(world)) / world
        grads.append(product(u, vs[k].t()))
    grads = [g.view_as(t) for g, t in zip(grads, local[0])]
    for r in range(world):
        for k in range(count):
            errors[r][k] = ms[r][k].view_as(grads[k]) - grads[k]
    return grads


# ---- the runs ---------------------------------------------------------------------------------------------


def make_problem(args):
    widths = (IN_FEATURES, *[args.width] * args.layers, OUT_FEATURES)
    model = layered_mlp(widths, seed=args.seed)
    batch = regression_batch(args.global_batch, IN_FEATURES, OUT_FEATURES, seed=args.seed + 1)
    return model, batch


def train_ddp(rt: Runtime, args, hook, ell: int, options=None) -> tuple[list[torch.Tensor], list[float], Ledger]:
    """--steps SGD steps under torch's DDP with `hook`: "none" (DDP's all-reduce), "torch" (torch's
    powerSGD_hook) or a hook of ours (`powersgd_hook`) on a LowRankState, either with `options` (an Options):
    the parameters, the loss on the whole batch after each step, and our state's ledger."""
    options = options or Options()
    model, batch = make_problem(args)
    whole = copy.deepcopy(model)
    x, y = (t.chunk(rt.world_size)[rt.rank] for t in batch)
    ddp, state = DDP(model), LowRankState(ell, args.min_compression_rate, args.seed, options=options)
    if callable(hook):
        ddp.register_comm_hook(state, hook)
    elif hook == "torch":
        torch_state = torch_powersgd.PowerSGDState(
            None, ell, min_compression_rate=args.min_compression_rate, random_seed=args.seed, **vars(options)
        )
        ddp.register_comm_hook(torch_state, torch_powersgd.powerSGD_hook)
    optimizer, losses = torch.optim.SGD(ddp.parameters(), lr=args.lr), []
    for _ in range(args.steps):
        optimizer.zero_grad()
        F.mse_loss(ddp(x), y).backward()
        optimizer.step()
        whole.load_state_dict(model.state_dict())
        with torch.no_grad():
            losses.append(F.mse_loss(whole(batch[0]), batch[1]).item())
    return [t.detach().clone() for t in model.parameters()], losses, state.ledger


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((u - v).abs().max().item() for u, v in zip(a, b))


# ---- the chapter, part by part ------------------------------------------------------------------------------


def show_equality(rt: Runtime, args, verdict: Verdict) -> dict:
    print0("\n[bold]1. By hand against torch's powerSGD_hook, the one-process algebra and plain DDP[/]")
    model, batch = make_problem(args)
    plain, plain_losses, _ = train_ddp(rt, args, "none", 0)
    rows, losses = [], {"uncompressed": plain_losses}
    for ell in sorted({*RANKS_SHOWN, args.approx_rank}):
        mine, losses[f"ell = {ell}"], _ = train_ddp(rt, args, powersgd_hook, ell)
        theirs, _, _ = train_ddp(rt, args, "torch", ell)
        alone = one_process(model, batch, args, rt.world_size, ell)
        to_torch, to_alone, to_plain = max_diff(mine, theirs), max_diff(mine, alone), max_diff(mine, plain)
        how = "Gram-Schmidt" if ell <= 2 else "Householder QR"
        verdict.check(f"ell = {ell}: by hand = torch's hook, bit for bit ({how})", to_torch == 0)
        bitwise_alone = rt.world_size <= 2  # a sum of two is the same in either order
        how = "bit for bit" if bitwise_alone else "to 1e-12"
        verdict.check(
            f"ell = {ell}: by hand = one process, {how}", to_alone == 0 if bitwise_alone else to_alone < 1e-12
        )
        verdict.check(f"ell = {ell}: differs from uncompressed DDP", to_plain > 1e-6, f"max |diff| {to_plain:.2e}")
        rows.append((str(ell), f"{to_torch:.1e}", f"{to_alone:.1e}", f"{to_plain:.1e}"))
    alone = one_process(model, batch, args, rt.world_size, None)
    verdict.check("uncompressed DDP = one process", max_diff(plain, alone) < 1e-12)
    print0(f"max |difference| of the parameters after {args.steps} SGD steps (the first {START_ITER} plain)")
    print0(rows_table("", ("ell", "vs torch's hook", "vs one process", "vs plain DDP"), rows))
    return losses


def show_bytes(rt: Runtime, args, verdict: Verdict) -> None:
    rate = args.min_compression_rate
    print0(f"\n[bold]2. Elements all-reduced per compressed step, ell = {args.approx_rank}, min rate {rate}[/]")
    model, _ = make_problem(args)
    _, _, ledger = train_ddp(rt, args, powersgd_hook, args.approx_rank)
    rows, total, plain = [], 0, 0
    for name, t in model.named_parameters():
        ell = compressed_rank(t.shape, args.approx_rank, args.min_compression_rate)
        sent = (t.shape[0] + t.shape[1]) * ell if ell else t.numel()
        total, plain = total + sent, plain + t.numel()
        shape = " x ".join(map(str, t.shape))
        rows.append((name, shape, f"{t.numel():,}", f"{sent:,}", f"(n + m) ell, ell = {ell}" if ell else "whole"))
    rows.append(("all", "", f"{plain:,}", f"{total:,}", f"{plain / total:.1f}x fewer"))
    print0(rows_table("", ("parameter", "n x m", "n m", "sent", "how"), rows))
    e, compressed_steps = model.parameters().__next__().element_size(), args.steps - START_ITER
    counted = ledger.sent - ledger.sent_in("plain")
    verdict.check(
        "bytes handed to the all-reduces = e (sum (n + m) ell + the rest whole) per step",
        counted == e * total * compressed_steps and ledger.sent_in("plain") == e * plain * START_ITER,
        f"{counted:,} bytes in {compressed_steps} steps",
    )
    verdict.figure("elements", {"compressed": total, "uncompressed": plain})


def show_losses(losses: dict, args, verdict: Verdict) -> None:
    print0("\n[bold]3. What the compression costs: the loss on the whole batch (measured, not bounded)[/]")
    marks = sorted({1, args.steps // 2, args.steps})
    rows = [(name, *(f"{run[k - 1]:.5f}" for k in marks)) for name, run in losses.items()]
    print0(rows_table("", ("gradient", *(f"step {k}" for k in marks)), rows))
    verdict.figure("losses", losses)


def parse_args():
    parser = lesson_parser(__doc__)
    parser.add_argument(
        "--approx-rank", type=positive_int, default=2, help="ell, columns of U and V (ell <= min(n, m))"
    )
    parser.add_argument("--width", type=positive_int, default=64, help="hidden width of the MLP")
    parser.add_argument("--layers", type=positive_int, default=3, help="hidden layers of the MLP")
    parser.add_argument("--global-batch", type=positive_int, default=48, help="rows per step, N (P must divide it)")
    parser.add_argument(
        "--min-compression-rate", type=positive_float, default=2.0, help="compress when (n + m) ell x rate < n m"
    )
    add_optimizer_args(parser, steps=12, lr=0.2)
    return parser.parse_args()


def world_rules(args, world_size: int) -> None:
    divides_global_batch(args, world_size)
    smallest = min(IN_FEATURES, OUT_FEATURES, args.width)
    require(
        args.approx_rank <= smallest,
        "--approx-rank",
        f"ell = {args.approx_rank} is larger than the smallest weight matrix allows (ell <= min(n, m) = {smallest})",
    )
    require(args.steps > START_ITER, "--steps", f"needs more than the {START_ITER} plain steps, got {args.steps}")


def main() -> int:
    args = check_flags_against_world(parse_args(), world_rules)
    with distributed("cpu" if args.device == "auto" else args.device) as rt:
        verdict = Verdict(rt)
        print0(
            f"[bold]Lesson 17: PowerSGD[/] - P = {rt.world_size}, N = {args.global_batch}, width {args.width}, "
            f"ell = {args.approx_rank}, {args.steps} SGD steps, float64, {rt.backend}"
        )
        losses = show_equality(rt, args, verdict)
        show_bytes(rt, args, verdict)
        show_losses(losses, args, verdict)
        return verdict.finish(args.json)


if __name__ == "__main__":
    run_main(main)
