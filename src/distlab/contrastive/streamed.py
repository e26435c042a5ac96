"""The streamed five-phase step: the exact global CLIP gradient with O(N d) memory per rank.

Global batch N over P ranks, C = N / P pairs per rank, embeddings Z_x, Z_y (N x d), logit scale
s = 1/tau (a config constant, or learned: returned by the model), R/Q the row/column softmax:

    S = s Z_x Z_y^T,   a_i = log sum_j exp S_ij,   b_j = log sum_i exp S_ij
    L = 1/(2N) sum_i (a_i + b_i - 2 S_ii)                      (symmetric InfoNCE, a mean over N)
    dL/dS_ij = W_ij / (2N),   W = R + Q - 2I,   R_ij = exp(S_ij - a_i),   Q_ij = exp(S_ij - b_j)
    G_x = dL/dZ_x = s/(2N) W Z_y,      G_y = dL/dZ_y = s/(2N) W^T Z_x

The learnable scale. S_ij = s z_i^x . z_j^y, so

    dL/ds = sum_ij dL/dS_ij (z_i^x . z_j^y) = 1/(2N) sum_ij W_ij z_i^x . z_j^y = (1/s) sum_i z_i^x . G_x,i

a sum over rows i of numbers Phase C already has (row i of Z_x and of G_x): no extra pass over the
tiles. Each rank adds its own rows' share, (1/s) sum_{i in rank} z_i^x . G_x,i, into the scale's VJP,
and the wrapper's reduction sums the ranks along with every other gradient. (With tower x frozen the
same number is (1/s) sum_j z_j^y . G_y,j.)

The phases, one function each:

  A  `phase_a_forward`: the local forward. One forward (B >= C): the rank's C pairs are one micro-batch,
     run once *with* grad through the wrapper; its graph is kept for D, no RNG replay is needed, and
     BatchNorm and dropout behave exactly as in plain DDP training. Recompute (B < C): the C pairs in
     micro-batches of at most B (sizes within one of each other), without grad, each one's random
     state saved (RandContext). Around it two tiny exchanges (see streamed_checks): the config and
     the batch sizes before it (`agree_before_forward`: a forward may communicate, so no rank runs
     one unless all do), the outputs after it (`agree_across_ranks`). Then `phase_a_gather`: one
     all-gather of detached copies, every rank holds Z_x, Z_y [sync 1].
  B  `phase_b_normalisers`: a, b and L in tiles of at most T x T. "sharded" (default): each rank
     streams its own C rows and C columns of S (2CN similarities), then one tiny all-gather of 2N
     floats and P loss partials. "replicated": every rank streams all N^2, rows and columns in one pass.
  C  `phase_c_embedding_grads`: one micro-batch's G_x, G_y (and its share of dL/ds) from the closed
     forms, in tiles of at most T x T (the micro-batch's rows in blocks of T, the global dimension in
     chunks of T): nothing N x N, C x N or B x N is made, and the tiles stay cache-sized whatever B is.
     Per micro-batch, C runs once D's outputs exist (`phase_d_outputs`): the kept graph (one forward)
     or a recompute under the saved random state (the same dropout masks).
  D  `phase_d_backward`: the VJP of the micro-batch: back-propagate m G (and m dL/ds) into that
     graph, where m is the wrapper's reduction factor (times a GradScaler's scale). An output that
     does not require grad (a locked tower, LiT) gets no G and no VJP; which ones do is read from the
     outputs themselves, since a frozen encoder's embedding may still pass through trainable
     parameters outside it (open_clip keeps text_projection on the model, not in a text module).
  E  the wrapper's reduction [sync 2]: every micro-batch's backward but the last runs with it off,
     so the gradient is reduced once, by the last backward of D (unless the caller's `no_sync()`
     defers it to a later call: gradient accumulation).

Why m = P for DDP. G carries L's 1/N, so the global gradient is the SUM over ranks of each rank's VJP;
DDP AVERAGES (divides by P); multiplying the VJP by P turns its average into the sum. FSDP2 divides by
its gradient divide factor (P unless changed), and m follows it (streamed_wrappers).

What each regime costs per rank. One forward (B >= C): C forwards, C backwards, the activations of all
C pairs held from A to D (as plain DDP holds them), plus O(N d) embeddings and T x T tiles. Recompute
(B < C): 2C forwards (the no-grad pass and the recompute), C backwards, the activations of one
micro-batch of B at a time, plus O(N d) and tiles of at most T x T. Loss machinery either way:
6 C N d multiply-adds (2 C N d in B, 4 C N d in C), the same as a C x N local loss and its backward.

Precision: streamed_precision (autocast, mixed dtypes; a, b, L, G in float32 or float64). Nothing
assumes unit-norm embeddings: G is the exact gradient of L for any Z and every exponential is of
S - LSE <= 0. a_i and S_ii are both of size s, so -log R_ii = a_i - S_ii and R_ii + Q_ii - 2 are
computed without subtracting them (streamed_kernels._finish).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.distributed as dist
from torch import nn

from distlab.contrastive.rand_context import RandContext
from distlab.contrastive.streamed_checks import (agree_across_ranks, agree_before_forward, check_locally,
                                                 check_outputs)
from distlab.contrastive.streamed_config import StreamConfig, parse_config
from distlab.contrastive.streamed_kernels import (streamed_lse, streamed_lse_both,
                                                  streamed_softmax_pair_product)
from distlab.contrastive.streamed_precision import compute_dtype, full_precision, surrogate_multiplier
from distlab.contrastive.streamed_wrappers import Wrapped, batchnorm_snapshot, first_device


@dataclass
class LocalForward:
    """Phase A before the gather: this rank's micro-batches and what the forward returned for each."""

    micro: list[slice]                 # local rows of each micro-batch
    outputs: list[tuple]               # (z_x, z_y, s or None) per micro-batch
    rng: list[RandContext]             # recompute: the random state each forward started from
    kept: bool                         # one forward: outputs carry the graph D back-propagates into


@dataclass
class Embedded:
    """Phase A's result: the gathered, detached embeddings in the compute dtype, and the scale."""

    z_x: torch.Tensor                  # N x d, every rank's rows in rank order
    z_y: torch.Tensor
    s: float                           # the logit scale, 1/tau or the model's


def phase_a_forward(wrapped: Wrapped, local_x: torch.Tensor, local_y: torch.Tensor,
                    cfg: StreamConfig) -> LocalForward:
    """One forward with grad (B >= C), or no-grad micro-batches with their random states (B < C)."""
    if cfg.one_forward:
        return LocalForward([slice(0, len(local_x))], [wrapped.model(local_x, local_y)], [], kept=True)
    micro = cfg.micro  # every rank's batch is C (checked before this forward)
    outputs, rng = [], []
    with torch.no_grad():
        for rows in micro:
            rng.append(RandContext(local_x[rows], local_y[rows]))
            outputs.append(wrapped.no_grad_forward(local_x[rows], local_y[rows]))
    return LocalForward(micro, outputs, rng, kept=False)


def gather_pairs(z_x: torch.Tensor, z_y: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """All-gather this rank's C x d z_x, z_y into N x d Z_x, Z_y in rank order, in the compute dtype:
    one collective for both (z_x | z_y side by side, in their own dtype when they share one; matmul
    reads the halves' row stride of 2d as is), upcast after."""
    dtype = compute_dtype(z_x.dtype, z_y.dtype)
    wire = z_x.dtype if z_x.dtype == z_y.dtype else dtype
    mine = torch.cat((z_x.to(wire), z_y.to(wire)), dim=1)
    gathered = mine.new_empty((n, mine.shape[1]))
    dist.all_gather_single(gathered, mine)
    gathered = gathered.to(dtype)
    return gathered[:, :z_x.shape[1]], gathered[:, z_x.shape[1]:]


def phase_a_gather(local: LocalForward, cfg: StreamConfig) -> Embedded:
    """Detached copies of this rank's embeddings, gathered [sync 1]; and the scale s."""
    z_x = torch.cat([out[0].detach() for out in local.outputs])
    z_y = torch.cat([out[1].detach() for out in local.outputs])
    s = 1.0 / cfg.tau if cfg.tau is not None else float(local.outputs[0][2].detach().double().reshape(()))
    return Embedded(*gather_pairs(z_x, z_y, cfg.n), s)


@dataclass
class Normalisers:
    """Phase B's result: what phase C needs, and the loss."""

    a: torch.Tensor                    # N row LSEs
    b: torch.Tensor                    # N column LSEs
    diag_coef: torch.Tensor            # W_ii = R_ii + Q_ii - 2 for this rank's C pairs
    loss: float


def phase_b_normalisers(emb: Embedded, cfg: StreamConfig) -> Normalisers:
    """a, b over the whole global batch, and L = 1/(2N) sum_i (nll_x_i + nll_y_i), where
    nll_x_i = a_i - S_ii = -log R_ii and nll_y_i = b_i - S_ii = -log Q_ii."""
    own = slice(cfg.offset, cfg.offset + cfg.local)
    if cfg.phase_b == "replicated":
        a, nll_x, b, nll_y = streamed_lse_both(emb.z_x, emb.z_y, emb.s, cfg.t)
        nll_x, nll_y, total = nll_x[own], nll_y[own], (nll_x + nll_y).sum()
    else:
        a_own, nll_x = streamed_lse(emb.z_x[own], emb.z_y, emb.s, cfg.t, cfg.offset)   # my rows of S
        b_own, nll_y = streamed_lse(emb.z_y[own], emb.z_x, emb.s, cfg.t, cfg.offset)   # my columns
        # One tiny all-gather: my a's, my b's and my share of the loss (2C + 1 floats per rank).
        mine = torch.cat((a_own, b_own, (nll_x + nll_y).sum().unsqueeze(0)))
        every = mine.new_empty(cfg.world * len(mine))
        dist.all_gather_single(every, mine)
        every = every.view(cfg.world, len(mine))
        a, b = every[:, :cfg.local].reshape(-1), every[:, cfg.local:2 * cfg.local].reshape(-1)
        total = every[:, -1].sum()  # the same numbers in the same order on every rank
    return Normalisers(a, b, torch.expm1(-nll_x) + torch.expm1(-nll_y), (total / (2 * cfg.n)).item())


def phase_c_embedding_grads(emb: Embedded, norm: Normalisers, rows: slice, cfg: StreamConfig,
                            needs: tuple[bool, bool, bool]) -> tuple[Any, Any, Any]:
    """(G_x, G_y, this micro-batch's share of dL/ds) for local `rows`, T x T tiles at a time. `needs`
    says which of z_x, z_y, s require grad; what is not needed is None and not computed (G_x is
    computed for dL/ds even when z_x needs none)."""
    glob = slice(cfg.offset + rows.start, cfg.offset + rows.stop)
    coef, scale = norm.diag_coef[rows], emb.s / (2 * cfg.n)
    g_x = g_y = g_s = None
    if needs[0] or needs[2]:
        g_x = streamed_softmax_pair_product(emb.z_x[glob] * emb.s, emb.z_y, norm.a[glob], norm.b, coef,
                                            glob.start, cfg.t).mul_(scale)
    if needs[1]:
        g_y = streamed_softmax_pair_product(emb.z_y[glob] * emb.s, emb.z_x, norm.b[glob], norm.a, coef,
                                            glob.start, cfg.t).mul_(scale)
    if needs[2]:
        g_s = (emb.z_x[glob] * g_x).sum() / emb.s      # dL/ds = (1/s) sum_i z_i^x . G_x,i
    return (g_x if needs[0] else None), g_y, g_s


def phase_d_outputs(wrapped: Wrapped, x: torch.Tensor, y: torch.Tensor,
                    replay: RandContext | tuple) -> tuple:
    """(z_x, z_y, s or None) with the graph D back-propagates into: the kept outputs (one forward), or
    a recompute under the random state Phase A saved (the same dropout masks)."""
    if not isinstance(replay, RandContext):
        return replay
    with replay:
        out = wrapped.model(x, y)
    return (*out, None) if len(out) == 2 else tuple(out)


def needs_of(outputs: tuple) -> tuple[bool, bool, bool]:
    """Which of (z_x, z_y, s) carry a graph to trainable parameters. Read from the outputs, not from
    encoder_x / encoder_y: a frozen encoder's embedding can still depend on trainable parameters
    outside it (open_clip's text_projection and ln_final sit on the model, not in a text module)."""
    return tuple(z is not None and z.requires_grad for z in outputs)


def phase_d_backward(outputs: tuple, grads: tuple, multiplier: torch.Tensor) -> None:
    """The micro-batch's VJP: backward of m <(z_x, z_y, s), (G_x, G_y, dL/ds)> into `outputs`' graph,
    each gradient in its output's dtype (m: the wrapper's reduction factor, times a GradScaler's)."""
    pairs = [(z, g) for z, g in zip(outputs, grads) if g is not None]
    if not pairs:
        return
    # d(m <z, g>)/dz = m g exactly, so this is the surrogate's backward without forming it.
    torch.autograd.backward([z for z, _ in pairs],
                            [(g * multiplier).to(z.dtype).reshape(z.shape) for z, g in pairs])


def loss_machinery(z_x: torch.Tensor, z_y: torch.Tensor, config: Mapping[str, Any]) -> tuple[float, Any, Any]:
    """The step without the encoders, for benchmarks and notebooks: this rank's C x d embeddings in,
    (L, G_x, G_y) for its rows out (the all-gather, Phase B, Phase C over every micro-batch). TAU
    is required; no checks, no exchange."""
    cfg = parse_config(config, dist.get_world_size(), dist.get_rank())
    micro = [slice(0, len(z_x))]
    emb = phase_a_gather(LocalForward(micro, [(z_x, z_y, None)], [], kept=False), cfg)
    with full_precision(emb.z_x.device):
        norm = phase_b_normalisers(emb, cfg)
        grads = [phase_c_embedding_grads(emb, norm, rows, cfg, (True, True, False))[:2]
                 for rows in cfg.micro]
    return norm.loss, torch.cat([g[0] for g in grads]), torch.cat([g[1] for g in grads])


def _run(model: nn.Module, local_x: torch.Tensor, local_y: torch.Tensor, config: Mapping[str, Any],
         grad_scaler: Any, stop_if_not_finite: bool) -> float:
    check = check_locally(model, local_x, local_y, config)
    device = first_device(check.wrapped.inner if check.wrapped else None, local_x)
    agree_before_forward(check, local_x, local_y, device)       # no rank's forward has run yet
    cfg, wrapped = check.cfg, check.wrapped
    restore_batchnorm = batchnorm_snapshot(wrapped.inner) if stop_if_not_finite else None
    local, failure, by_model = None, None, True
    try:
        local = phase_a_forward(wrapped, local_x, local_y, cfg)                          # A
        by_model = False
        local.outputs = [check_outputs(out, rows.stop - rows.start, cfg)
                         for out, rows in zip(local.outputs, local.micro)]
    except Exception as err:  # noqa: BLE001 - this rank still joins the exchange, then every rank raises
        local, failure = None, err
    agree_across_ranks(failure, by_model, local.outputs[0] if local else None, cfg, device)
    emb = phase_a_gather(local, cfg)                                                      # sync 1
    with full_precision(emb.z_x.device):
        norm = phase_b_normalisers(emb, cfg)                                              # B
    if stop_if_not_finite and not math.isfinite(norm.loss):
        restore_batchnorm()  # the forward's update of BatchNorm's running statistics is undone too
        raise FloatingPointError(f"the global loss is {norm.loss} (non-finite embeddings on some rank): "
                                 "no gradient was computed, the optimizer did not step, BatchNorm's statistics "
                                 "are as they were")
    multiplier = surrogate_multiplier(check.factor, grad_scaler, emb.z_x)
    last = len(local.micro) - 1
    for k, rows in enumerate(local.micro):
        # E: the wrapper reduces in the last micro-batch's backward only (a recompute's forward must
        # run inside the same no_sync, where DDP decides whether its backward reduces).
        with wrapped.accumulating(k == last):
            outputs = phase_d_outputs(wrapped, local_x[rows], local_y[rows],
                                      local.outputs[0] if local.kept else local.rng[k])
            with full_precision(emb.z_x.device):
                grads = phase_c_embedding_grads(emb, norm, rows, cfg, needs_of(outputs))  # C
            phase_d_backward(outputs, grads, multiplier)                                   # D
    return norm.loss


def distributed_backward(model: nn.Module, local_x: torch.Tensor, local_y: torch.Tensor,
                         config: Mapping[str, Any], *, grad_scaler: Any = None) -> float:
    """Add the exact gradient of the global symmetric InfoNCE into `.grad`, like `loss.backward()`.

    It neither zeroes the gradients nor steps; it returns the global loss as a Python float (computed
    in float32, or float64 for a float64 model), non-finite as it is if some rank's embeddings were.
    `model` is DDP, torch.compile(DDP) or FSDP2-wrapped; its forward(x, y) returns (z_x, z_y) or
    (z_x, z_y, s) with s the logit scale (then config has no TAU); `encoder_x` and `encoder_y` sit on
    the wrapped module. config: GLOBAL_BATCH_SIZE (N), MICRO_BATCH_SIZE (B), STREAM_CHUNK_SIZE (T),
    TAU unless the model returns s, optional PHASE_B ("sharded" | "replicated"). With `grad_scaler`
    (torch.amp.GradScaler) the VJP is scaled as scaler.scale(loss).backward() would scale it. Called
    inside `model.no_sync()` it accumulates without reducing; the next call outside reduces, once.
    Bad inputs raise the same ValueError on every rank before the first all-gather (a RuntimeError
    when model(x, y) itself raised on some rank).
    """
    return _run(model, local_x, local_y, config, grad_scaler, stop_if_not_finite=False)


def distributed_train_step(model: nn.Module, optimizer: torch.optim.Optimizer, local_x: torch.Tensor,
                           local_y: torch.Tensor, config: Mapping[str, Any]) -> float:
    """One optimiser step on the exact symmetric InfoNCE of the global batch; returns its loss.

    zero_grad, `distributed_backward`, optimizer.step(). A non-finite loss raises FloatingPointError
    on every rank before any backward: parameters, optimizer state and BatchNorm statistics untouched.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    optimizer.zero_grad(set_to_none=True)
    loss = _run(model, local_x, local_y, config, None, stop_if_not_finite=True)
    optimizer.step()
    return loss
