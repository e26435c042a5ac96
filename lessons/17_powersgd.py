"""Lesson 17: PowerSGD, gradients all-reduced as low-rank factors, by hand as a DDP communication hook, proven
equal to torch's `powerSGD_hook` and to the same algebra in one process.

    torchrun --nproc-per-node 2 lessons/17_powersgd.py     # any P that divides N (48: P = 1..4)

Data parallelism (lesson 06) all-reduces every gradient: 2(P-1)/P x e n m bytes per rank for an n x m weight
(e bytes per element). PowerSGD (Vogels et al. 2019, https://arxiv.org/abs/1905.13727) sends two thin factors
instead. Rank p holds its gradient G_p, adds the error it kept last step, M_p = G_p + E_p, and with Q an m x r
matrix of orthonormal columns (r the rank, r << n, m):

    1. P_p = M_p Q                      n x r              all-reduce:  P = sum_p P_p = (sum_p M_p) Q
    2. P <- orthonormal columns of P    (Gram-Schmidt, below; no communication)
    3. Q_p = M_p^T P                    m x r              all-reduce:  Q = (1/P) sum_p Q_p = Mbar^T P
    4. the gradient every rank uses:    P Q^T = P P^T Mbar, the mean Mbar projected on r directions
    5. error feedback:                  E_p <- M_p - P Q^T, what this rank's share lost, added back next step

One step of the power iteration per training step: Q is kept from the last step (warm start) and
re-orthonormalised, so over steps it tracks Mbar's top-r right singular vectors at the price of one matmul
pair. Bytes: (n + m) r elements instead of n m. A matrix for which that saves too little (torch's
`min_compression_rate`: compress when (n + m) r x rate < n m) and every one-dimensional tensor (biases) is
all-reduced whole, and the error feedback covers them too: E_p <- M_p - mean, zero in sum over the ranks.

Every step is linear in the sum over ranks except the orthonormalisation, which acts on the summed P: so the
result depends on the ranks' gradients only through their mean, and equals one process running the same
algebra on the P shares: bit for bit at P <= 2 (a sum of two numbers is the same in either order), to 1e-12
at P >= 3 (gloo's ring adds in another order). DDP rebuilds its buckets after its first step, so the hook
all-reduces plainly for the first START_ITER steps (torch refuses fewer than 2 with warm start or error feedback).

The hook below (`powersgd_hook`) runs under torch's DDP (`register_comm_hook`): DDP hands it one bucket of
gradients at a time, the flat buffer and views of each parameter's gradient in it, and takes back the
buffer it should write into the parameters' .grad. Its twin is torch's
`torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook`: at r <= 2 torch orthonormalises by the same
Gram-Schmidt and the two agree bit for bit; at r > 2 it calls Householder QR (LAPACK) and they agree to
rounding (1e-12 in float64). What compression costs is measured, not bounded: the loss after a few steps
at r = 1, 2, 4 beside uncompressed DDP.
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations, as types, at registration.
import copy

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd
from torch.nn.parallel import DistributedDataParallel as DDP

from distlab.cli import (
    add_optimizer_args,
    check_flags_against_world,
    divides_global_batch,
    lesson_parser,
    positive_float,
    positive_int,
    require,
)
from distlab.comm.ledger import Ledger
from distlab.console import print0, rows_table
from distlab.models import layered_mlp, regression_batch
from distlab.runtime import Runtime, distributed, run_main
from distlab.verdict import Verdict

START_ITER = 2  # plain all-reduces first: DDP rebuilds its buckets after step 1 (torch's start_powerSGD_iter)
IN_FEATURES, OUT_FEATURES = 16, 8
RANKS_SHOWN = (1, 2, 4)  # the loss table's r, with --rank added

# ---- the mechanism: the low-rank all-reduce as a DDP communication hook -----------------------------------


def orthonormalise(columns: torch.Tensor) -> None:
    """Gram-Schmidt in place on an n x r matrix: column i divided by its norm, then its component removed
    from every later column j: a_j <- a_j - (a_i . a_j) a_i. Afterwards columns^T columns = I (to rounding).
    (torch's hook removes it from all later columns in one vectorised sum: the same numbers at r <= 2.)"""
    r = columns.shape[1]
    for i in range(r):
        col = columns[:, i]
        col /= torch.norm(col)
        for j in range(i + 1, r):
            later = columns[:, j]
            later -= torch.sum(col * later) * col


def compressed_rank(shape: torch.Size, r: int, min_compression_rate: float) -> int:
    """The rank a gradient of this shape is sent at: 0 when it goes whole (a vector, or (n + m) r x rate not
    below n m), else min(n, m, r)."""
    if len(shape) < 2:
        return 0
    n, m = shape[0], shape[1:].numel()
    r = min(n, m, r)
    return r if (n + m) * r * min_compression_rate < n * m else 0


class LowRankState:
    """What the hook keeps between steps, per bucket: the error E_p, the warm-started Q's (one flat buffer),
    the step count; and the bytes it handed to each all-reduce (`ledger`, phases "plain", "whole", "P", "Q")."""

    def __init__(self, r: int, min_compression_rate: float = 2.0, seed: int = 0, group=None):
        self.r, self.min_compression_rate, self.group = r, min_compression_rate, group
        self.rng = np.random.RandomState(seed)  # draws one seed per bucket for its first Q (as torch's state does)
        self.step, self.errors, self.qs = 0, {}, {}
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
    P Q^T (compressed) or the mean (sent whole). Every rank ends with the same buffer."""
    flat, world = bucket.buffer(), dist.get_world_size(state.group)
    if state.step < START_ITER:  # the plain mean, (1/P) sum_p G_p
        flat.div_(world)
        state.all_reduce(flat, "plain")
        state.bucket_done(bucket)
        return done(flat)
    index = bucket.index()
    flat.add_(state.errors.setdefault(index, torch.zeros_like(flat)))  # M_p = G_p + E_p, the whole bucket
    before = flat.clone()
    grads = bucket.gradients()  # views into `flat`: writing them writes the buffer DDP returns
    ranks = [compressed_rank(g.shape, state.r, state.min_compression_rate) for g in grads]
    whole = [g for g, r in zip(grads, ranks) if r == 0]
    mats = [g.view(g.shape[0], -1) for g, r in zip(grads, ranks) if r > 0]
    rs = [r for r in ranks if r > 0]
    # the tensors sent whole: one all-reduce of their concatenation, then the mean back in place
    packed = torch.cat([g.view(-1) for g in whole]) if whole else flat.new_empty(0)
    state.all_reduce(packed, "whole")
    packed.div_(world)
    for g, mean in zip(whole, packed.split([g.numel() for g in whole])):
        g.copy_(mean.view_as(g))
    if index not in state.qs:  # the first compressed step: Q drawn from N(0, 1), seeded alike on every rank
        state.qs[index] = flat.new_empty(sum(m.shape[1] * r for m, r in zip(mats, rs)))
        gen = torch.Generator().manual_seed(int(state.rng.randint(1_000_000_000)))
        for q in views(state.qs[index], [(m.shape[1], r) for m, r in zip(mats, rs)]):
            q.copy_(torch.randn(*q.shape, generator=gen, dtype=q.dtype))
    qs = views(state.qs[index], [(m.shape[1], r) for m, r in zip(mats, rs)])
    for q in qs:
        orthonormalise(q)  # warm start: last step's Q, re-orthonormalised
    p_flat = flat.new_empty(sum(m.shape[0] * r for m, r in zip(mats, rs)))
    ps = views(p_flat, [(m.shape[0], r) for m, r in zip(mats, rs)])
    for m, q, p in zip(mats, qs, ps):
        product(m, q, out=p)  # 1. P_p = M_p Q
    state.all_reduce(p_flat, "P")  # sum_p M_p Q: no 1/P, the orthonormalisation forgets the scale
    for p in ps:
        orthonormalise(p)  # 2.
    for m, p, q in zip(mats, ps, qs):
        product(m.t(), p, out=q)  # 3. Q_p = M_p^T P
    state.all_reduce(state.qs[index], "Q")
    state.qs[index].div_(world)  # Q = Mbar^T P, kept for the next step
    for m, p, q in zip(mats, ps, qs):
        product(p, q.t(), out=m)  # 4. P Q^T, written into the bucket
    state.errors[index] = before - flat  # 5. E_p = M_p - what every rank now uses
    state.bucket_done(bucket)
    return done(flat)


# ---- the reference: the same algebra in one process, on the P shares of the batch -------------------------


def one_process(model: nn.Module, batch, args, world: int, r: int | None) -> list[torch.Tensor]:
    """The parameters after --steps SGD steps of a deep copy, each step's gradient formed in this one
    process from the P ranks' gradients (plain autograd on each rank's rows), mean, or (r given) the
    low-rank algebra of the docstring. DDP's one bucket lists the gradients last layer first: so are the
    first Q's drawn."""
    model = copy.deepcopy(model)
    params = list(model.parameters())
    shares = [[t.chunk(world)[p] for t in batch] for p in range(world)]
    errors = [[torch.zeros_like(t) for t in params] for _ in range(world)]
    rng, qs = np.random.RandomState(args.seed), {}
    optimizer = torch.optim.SGD(params, lr=args.lr)  # torch's SGD, as under DDP: p + (-lr) g, one rounding
    for step in range(args.steps):
        local = [torch.autograd.grad(F.mse_loss(model(x), y), params) for x, y in shares]
        if r is None or step < START_ITER:
            grads = [sum(g[k] / world for g in local) for k in range(len(params))]
        else:
            grads = reference_step(local, errors, qs, rng, r, args.min_compression_rate)
        for t, g in zip(params, grads):
            t.grad = g
        optimizer.step()
    return [t.detach() for t in params]


def gram_schmidt(a: torch.Tensor) -> None:
    """The reference's Gram-Schmidt (the arithmetic of `orthonormalise`, on a plain matrix)."""
    for i in range(a.shape[1]):
        a[:, i] /= a[:, i].norm()
        for j in range(i + 1, a.shape[1]):
            a[:, j] -= (a[:, i] * a[:, j]).sum() * a[:, i]


def reference_step(local, errors, qs: dict, rng, r: int, rate: float) -> list[torch.Tensor]:
    """One compressed step, parameter by parameter; `errors[p][k]` and `qs[k]` carried between steps."""
    world, count = len(local), len(local[0])
    ms = [[local[p][k] + errors[p][k] for k in range(count)] for p in range(world)]
    order = [k for k in reversed(range(count)) if compressed_rank(ms[0][k].shape, r, rate)]
    if not qs:
        gen = torch.Generator().manual_seed(int(rng.randint(1_000_000_000)))
        for k in order:
            n, m = ms[0][k].shape
            qs[k] = torch.randn(m, min(n, m, r), generator=gen, dtype=ms[0][k].dtype)
    grads = []
    for k in range(count):
        if k not in qs:
            grads.append(sum(ms[p][k] for p in range(world)) / world)
            continue
        gram_schmidt(qs[k])
        big_p = sum(product(ms[p][k], qs[k]) for p in range(world))
        gram_schmidt(big_p)
        qs[k] = sum(product(ms[p][k].t(), big_p) for p in range(world)) / world
        grads.append(product(big_p, qs[k].t()))
    for p in range(world):
        for k in range(count):
            errors[p][k] = ms[p][k] - grads[k]
    return grads


# ---- the runs ---------------------------------------------------------------------------------------------


def make_problem(args):
    widths = (IN_FEATURES, *[args.width] * args.layers, OUT_FEATURES)
    model = layered_mlp(widths, seed=args.seed)
    batch = regression_batch(args.global_batch, IN_FEATURES, OUT_FEATURES, seed=args.seed + 1)
    return model, batch


def train_ddp(rt: Runtime, args, hook, r: int) -> tuple[list[torch.Tensor], list[float], Ledger]:
    """--steps SGD steps under torch's DDP with `hook`: "none" (DDP's all-reduce), "torch" (torch's
    powerSGD_hook) or a hook of ours (`powersgd_hook`) on a LowRankState: the parameters, the loss on the
    whole batch after each step, and our state's ledger."""
    model, batch = make_problem(args)
    whole = copy.deepcopy(model)
    x, y = (t.chunk(rt.world_size)[rt.rank] for t in batch)
    ddp, state = DDP(model), LowRankState(r, args.min_compression_rate, args.seed)
    if callable(hook):
        ddp.register_comm_hook(state, hook)
    elif hook == "torch":
        torch_state = torch_powersgd.PowerSGDState(
            None, r, START_ITER, args.min_compression_rate, random_seed=args.seed
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
    for r in sorted({*RANKS_SHOWN, args.rank}):
        mine, losses[f"r = {r}"], _ = train_ddp(rt, args, powersgd_hook, r)
        theirs, _, _ = train_ddp(rt, args, "torch", r)
        alone = one_process(model, batch, args, rt.world_size, r)
        to_torch, to_alone, to_plain = max_diff(mine, theirs), max_diff(mine, alone), max_diff(mine, plain)
        bitwise_torch = r <= 2  # torch's Gram-Schmidt; Householder QR above
        how = "bit for bit" if bitwise_torch else "to 1e-12 (torch: QR)"
        verdict.check(f"r = {r}: by hand = torch's hook, {how}", to_torch == 0 if bitwise_torch else to_torch < 1e-12)
        bitwise_alone = rt.world_size <= 2  # a sum of two is the same in either order
        how = "bit for bit" if bitwise_alone else "to 1e-12"
        verdict.check(f"r = {r}: by hand = one process, {how}", to_alone == 0 if bitwise_alone else to_alone < 1e-12)
        verdict.check(f"r = {r}: differs from uncompressed DDP", to_plain > 1e-6, f"max |diff| {to_plain:.2e}")
        rows.append((str(r), f"{to_torch:.1e}", f"{to_alone:.1e}", f"{to_plain:.1e}"))
    alone = one_process(model, batch, args, rt.world_size, None)
    verdict.check("uncompressed DDP = one process", max_diff(plain, alone) < 1e-12)
    print0(f"max |difference| of the parameters after {args.steps} SGD steps (the first {START_ITER} plain)")
    print0(rows_table("", ("r", "vs torch's hook", "vs one process", "vs plain DDP"), rows))
    return losses


def show_bytes(rt: Runtime, args, verdict: Verdict) -> None:
    print0(
        f"\n[bold]2. Elements all-reduced per compressed step, r = {args.rank}, min rate {args.min_compression_rate}[/]"
    )
    model, _ = make_problem(args)
    _, _, ledger = train_ddp(rt, args, powersgd_hook, args.rank)
    rows, total, plain = [], 0, 0
    for name, t in model.named_parameters():
        r = compressed_rank(t.shape, args.rank, args.min_compression_rate)
        sent = (t.shape[0] + t.shape[1]) * r if r else t.numel()
        total, plain = total + sent, plain + t.numel()
        shape = " x ".join(map(str, t.shape))
        rows.append((name, shape, f"{t.numel():,}", f"{sent:,}", f"(n + m) r, r = {r}" if r else "whole"))
    rows.append(("all", "", f"{plain:,}", f"{total:,}", f"{plain / total:.1f}x fewer"))
    print0(rows_table("", ("parameter", "n x m", "n m", "sent", "how"), rows))
    e, compressed_steps = model.parameters().__next__().element_size(), args.steps - START_ITER
    counted = ledger.sent - ledger.sent_in("plain")
    verdict.check(
        "bytes handed to the all-reduces = e (sum (n + m) r + the rest whole) per step",
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
    parser.add_argument("--rank", type=positive_int, default=2, help="r, columns of P and Q (r <= min(n, m))")
    parser.add_argument("--width", type=positive_int, default=64, help="hidden width of the MLP")
    parser.add_argument("--layers", type=positive_int, default=3, help="hidden layers of the MLP")
    parser.add_argument("--global-batch", type=positive_int, default=48, help="rows per step, N (P must divide it)")
    parser.add_argument(
        "--min-compression-rate", type=positive_float, default=2.0, help="compress when (n + m) r x rate < n m"
    )
    add_optimizer_args(parser, steps=12, lr=0.2)
    return parser.parse_args()


def world_rules(args, world_size: int) -> None:
    divides_global_batch(args, world_size)
    smallest = min(IN_FEATURES, OUT_FEATURES, args.width)
    require(
        args.rank <= smallest,
        "--rank",
        f"r = {args.rank} is larger than the smallest weight matrix allows (r <= min(n, m) = {smallest})",
    )
    require(args.steps > START_ITER, "--steps", f"needs more than the {START_ITER} plain steps, got {args.steps}")


def main() -> int:
    args = check_flags_against_world(parse_args(), world_rules)
    with distributed("cpu" if args.device == "auto" else args.device) as rt:
        verdict = Verdict(rt)
        print0(
            f"[bold]Lesson 17: PowerSGD[/] - P = {rt.world_size}, N = {args.global_batch}, width {args.width}, "
            f"r = {args.rank}, {args.steps} SGD steps, float64, {rt.backend}"
        )
        losses = show_equality(rt, args, verdict)
        show_bytes(rt, args, verdict)
        show_losses(losses, args, verdict)
        return verdict.finish(args.json)


if __name__ == "__main__":
    run_main(main)
