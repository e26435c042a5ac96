"""The streamed step, and the front door of `distlab.streamed`: the exact global CLIP gradient with O(N d) memory
per rank, in five phases. `_run` below reads them top to bottom, one line each; the phases follow it in the order
they run; every other module the step calls is named at the end of this docstring, for the one job it does.

Global batch N over P ranks, C = N / P pairs per rank, embeddings Z_x, Z_y (N x d), logit scale s
(1/tau, or the model's own), R / Q the row / column softmax of S (lesson 25 derives every line):

    S = s Z_x Z_y^T,   a_i = log sum_j exp S_ij,   b_j = log sum_i exp S_ij
    L = 1/(2N) sum_i (a_i + b_i - 2 S_ii)
    dL/d(z_i^x . z_j^y) = s (R_ij + Q_ij - 2 delta_ij) / (2N),   R_ij = exp(S_ij - a_i),   Q_ij = exp(S_ij - b_j)
    G_x,i = s/(2N) sum_j (R_ij + Q_ij - 2 delta_ij) z_j^y,   G_y,j = s/(2N) sum_i (R_ij + Q_ij - 2 delta_ij) z_i^x
    dL/ds = (1/s) sum_i z_i^x . G_x,i      (each rank adds its own rows' share)

The step, in the order it runs (`distributed_train_step` is zero_grad, `distributed_backward`, the last guard,
optimizer.step(); `distributed_backward` is `_run`):

guard    `guarded_step` around it all (a peer that dies is named; every error ends with the exit hint), then
         `ready_step`: a step every rank agreed to run (config, wrapper, batch), or the same error on every rank.
phase 1  `phase1_forward`: the local forward, its outputs agreed across ranks (`Ready.agreed_outputs`).
         B >= C: one forward with grad, its graph kept for phase 4. B < C: micro-batches of at most
         B rows (`config.micro`) without grad, each one's random state saved. Then
         `gather_embeddings`: one all-gather of detached copies [sync 1].
phase 2  `phase2_normalisers`: a, b and L over T x T tiles. "sharded": each rank its own C rows and C
         columns of S, then a tiny all-gather of 2N floats; "replicated": all N^2 each.
guard    `loss_not_finite`: a non-finite L stops `distributed_train_step` here, before any backward.
phase 3  `phase3_embedding_grads`: one micro-batch's G_x, G_y (and its share of dL/ds) over T x T tiles.
phase 4  `phase4_outputs`, `phase4_backward`: the micro-batch's outputs with a graph (the kept ones,
         or a recompute under the saved random state), and the VJP of m G into them, where m is the
         wrapper's reduction factor (its average of the ranks' VJPs becomes their sum: the gradient).
phase 5  the wrapper's reduction [sync 2]: every micro-batch's backward but the last runs with it off.
guard    `agree_gradients_finite` (`distributed_train_step`): a non-finite gradient on any rank, no step.

The sigmoid loss (a model returning a logit bias) and EXCHANGE "ring" take phases 1-3 in one call instead,
`exchange.rank_shares`: this rank's G for all its C rows, then phases 4 and 5 as above. Every exchange runs over
the wrapper's process group. Cost per rank: 6 C N d multiply-adds of loss machinery, O(N d) memory plus tiles
of at most T x T (the kernels' tiles live in registers).

What the step calls, one job each:
  `safeguards`     the guards above, one entry per phase (`step_call`, `finite`, `peers`, `exit_hint`)
  `config`         the config dict read into the names the math uses (N, B, T, TAU, NORMALISERS, EXCHANGE, ...)
  `wrappers`       DDP, torch.compile(DDP), FSDP2: the inner model, its group and reduction factor, no_sync;
                   BatchNorm's statistics kept; the compute dtype; the surrogate's multiplier m
  `exchange`       how the embeddings meet: the gather (`gather_pairs`, the bytes in `step_ledger`) or, for the
                   sigmoid loss and the ring, a rank's shares at once (`rank_shares`; the ring's passes: `ring`)
  `kernel_choice`  KERNELS: who does phases 2 and 3's tile work, behind one interface (`TileOps`): the torch tiles
                   (`torch_tiles`, `sigmoid`) or the Triton kernels (`kernels`)
  `own_block`      the torch tiles' phases 2 and 3 with a rank's own block of S made once for rows and columns
  `precision`      MATMUL_PRECISION, pinned around the tiles
  `chunk_size`     T when the config leaves it out, and the warning when a T launches too many kernels
  `distlab.pieces` a micro-batch's rows cut from any input structure (`split_inputs`), its random state
                   replayed for the recompute (`random_state`)
Beside the step, calling into it: `loss_modules` (the same loss as open_clip-style modules), `loss_machinery`
below (the step without encoders, for benchmarks), `rank_work` (one rank's tile work, counted by `launch_count`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from distlab.pieces.random_state import RandContext
from distlab.pieces.split_inputs import take_rows
from distlab.streamed import safeguards
from distlab.streamed.chunk_size import chunk_for, warn_if_many_launches
from distlab.streamed.config import StreamConfig, parse_config
from distlab.streamed.exchange import all_gather_counted, gather_pairs, rank_shares, step_ledger
from distlab.streamed.kernel_choice import TileOps, kernels_problem, tile_ops
from distlab.streamed.own_block import block_pair_products, own_lse
from distlab.streamed.precision import pinned
from distlab.streamed.sigmoid import Logits
from distlab.streamed.torch_tiles import Pairing
from distlab.streamed.wrappers import Wrapped, batchnorm_snapshot, compute_dtype, surrogate_multiplier

# The step: the public calls, and the five phases one line each.


def distributed_train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    local_x: Any,
    local_y: Any,
    config: Mapping[str, Any],
) -> float:
    """One optimiser step on the exact symmetric InfoNCE of the global batch; returns its loss.

    zero_grad, `distributed_backward`, optimizer.step(). A non-finite loss raises FloatingPointError
    on every rank before any backward: parameters, optimizer state and BatchNorm statistics untouched.
    A finite loss whose backward makes a non-finite gradient (an overflow in a tower's backward, a NaN
    from a sqrt at 0) raises FloatingPointError on every rank before the step (`agree_gradients_finite`):
    parameters and optimizer state untouched, the gradients dropped (set to None).
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        problem = f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        raise safeguards.with_hint(ValueError(problem))
    optimizer.zero_grad(set_to_none=True)
    loss = _run(model, local_x, local_y, config, None, stop_if_not_finite=True)
    try:
        safeguards.agree_gradients_finite(model)
    except FloatingPointError:
        optimizer.zero_grad(set_to_none=True)  # nothing non-finite is left for a later step() to apply
        raise
    optimizer.step()
    return loss


def distributed_backward(
    model: nn.Module,
    local_x: Any,
    local_y: Any,
    config: Mapping[str, Any],
    *,
    grad_scaler: Any = None,
) -> float:
    """Add the exact gradient of the global symmetric InfoNCE (or, for a model returning (z_x, z_y, s, beta) or
    open_clip's dict with a logit_bias, of the sigmoid loss: `sigmoid`) into `.grad`, like `loss.backward()`.
    EXCHANGE: "ring" in config passes C x d blocks rank to rank instead of gathering N x 2d (`ring`).

    It neither zeroes the gradients nor steps; it returns the global loss as a Python float (computed
    in float32, or float64 for a float64 model), non-finite as it is if some rank's embeddings were.
    local_x and local_y are this rank's C pairs: each a tensor, or a dict, list or tuple of tensors that
    share their first dimension (a tokenizer's input_ids and attention_mask; None values pass as they
    are), handed to model(x, y) as given; a micro-batch is the same structure cut to its rows.
    `model` is DDP, torch.compile(DDP) or FSDP2-wrapped; its forward(x, y) returns (z_x, z_y) or
    (z_x, z_y, s) with s the logit scale (then config has no TAU), or open_clip's dict of them
    (output_dict=True); what trains is read from the parameters and from which outputs require grad.
    N is the batch of the wrapper's process group (a DDP subgroup: its ranks only). config:
    GLOBAL_BATCH_SIZE (N), MICRO_BATCH_SIZE (B), TAU unless the model returns s; optional
    STREAM_CHUNK_SIZE (T), NORMALISERS ("sharded" | "replicated"), EXCHANGE ("gather" | "ring"),
    KERNELS ("auto" | "torch" | "triton" | "triton-mm"), MATMUL_PRECISION ("float32" | "tf32" | "bf16"), as
    `config` describes them. With `grad_scaler` (torch.amp.GradScaler) the
    VJP is scaled as scaler.scale(loss).backward() would scale it. Called inside `model.no_sync()` it
    accumulates without reducing; the next call outside reduces, once. Bad inputs raise the same
    ValueError on every rank before the first all-gather (a RuntimeError when model(x, y) itself
    raised on some rank); a rank that dies during the step's exchanges is named in a RuntimeError on
    the ranks still running (`safeguards.peers`). Every error ends with the reminder to call
    distributed_clip.release_process_group() before exiting (`safeguards.exit_hint`).
    """
    return _run(model, local_x, local_y, config, grad_scaler, stop_if_not_finite=False)


def _run(
    model: nn.Module,
    local_x: Any,
    local_y: Any,
    config: Mapping[str, Any],
    grad_scaler: Any,
    stop_if_not_finite: bool,
) -> float:
    with safeguards.guarded_step(model):  # around it all: a dead peer named, every error ends with the exit hint
        ready = safeguards.ready_step(model, local_x, local_y, config)  # a step every rank agreed to, or one error
        cfg, wrapped = ready.cfg, ready.wrapped
        step_ledger.clear()
        restore_batchnorm = batchnorm_snapshot(wrapped.inner) if stop_if_not_finite else None
        local = phase1_forward(ready, local_x, local_y)  # phase 1, its outputs agreed across ranks
        ops = step_tile_ops(cfg, local.outputs[0][0], local.outputs[0][1])  # torch tiles or kernels, T
        s = 1.0 / cfg.tau if cfg.tau is not None else _float(local.outputs[0][2])
        sigmoid, shares, emb = local.outputs[0][3] is not None, None, None
        if sigmoid or cfg.exchange == "ring":  # phases 1-3 at once: G for all C rows (the ring, or the sigmoid loss)
            z_x, z_y = (torch.cat([out[i].detach() for out in local.outputs]) for i in (0, 1))
            logits = Logits(s, _float(local.outputs[0][3])) if sigmoid else s
            shares, loss = rank_shares(z_x, z_y, logits, cfg.exchange, ops, cfg.group)
            like, why = shares.g_x, "non-finite embeddings on some rank, or logits that overflowed"
        else:
            emb = gather_embeddings(local, cfg, ops)  # phase 1's sync 1
            norm = phase2_normalisers(emb, cfg, ops)  # phase 2
            loss, like = norm.loss, emb.z_x
            why = "" if math.isfinite(loss) else safeguards.embeddings_not_finite(emb.z_x, emb.z_y, emb.s, cfg)
        if stop_if_not_finite and not math.isfinite(loss):  # guard: a non-finite loss reaches no parameter
            restore_batchnorm()  # the forward's update of BatchNorm's running statistics is undone too
            raise safeguards.loss_not_finite(loss, why)
        multiplier = surrogate_multiplier(ready.factor, grad_scaler, like)
        for k, rows in enumerate(local.micro):
            # Phase 5: the wrapper reduces in the last micro-batch's backward only (a recompute's forward
            # runs inside the same no_sync, where DDP decides whether its backward reduces).
            last = k == len(local.micro) - 1
            with wrapped.accumulating(reduce=last):
                outputs = phase4_outputs(wrapped, take_rows(local_x, rows), take_rows(local_y, rows), local, k)
                if shares is not None:
                    grads = _shared_grads(shares, rows, last, needs_of(outputs))
                else:
                    grads = phase3_embedding_grads(emb, norm, rows, cfg, needs_of(outputs), ops)  # phase 3
                phase4_backward(outputs, grads, multiplier)  # phase 4
        return loss


# Phase 1: the local forward, and the gather.


@dataclass
class LocalForward:
    """Phase 1 before the gather: this rank's micro-batches and what the forward returned for each."""

    micro: list[slice]  # local rows of each micro-batch
    outputs: list[safeguards.Outputs]  # (z_x, z_y, s or None, beta or None) per micro-batch
    rng: list[RandContext]  # recompute: the random state each forward started from
    kept: bool  # one forward: outputs carry the graph phase 4 back-propagates into


def phase1_forward(ready: safeguards.Ready, local_x: Any, local_y: Any) -> LocalForward:
    """One forward with grad (B >= C), or no-grad micro-batches with their random states (B < C).
    A micro-batch of a dict, list or tuple input is the same structure cut to its rows (`take_rows`)."""
    cfg, wrapped = ready.cfg, ready.wrapped
    if cfg.one_forward:
        outputs = ready.agreed_outputs(lambda: [wrapped.model(local_x, local_y)], [cfg.local])
        return LocalForward([slice(0, cfg.local)], outputs, [], kept=True)
    rng: list[RandContext] = []

    def forward() -> list:
        outputs = []
        with torch.no_grad():
            for rows in cfg.micro:  # the random state each micro-batch starts from, saved before it runs
                x, y = take_rows(local_x, rows), take_rows(local_y, rows)
                rng.append(RandContext(wrapped.model, x, y))
                outputs.append(wrapped.no_grad_forward(x, y))
        return outputs

    outputs = ready.agreed_outputs(forward, [rows.stop - rows.start for rows in cfg.micro])
    return LocalForward(cfg.micro, outputs, rng, kept=False)


@dataclass
class Embedded:
    """The gathered, detached embeddings in the compute dtype, and the scale."""

    z_x: torch.Tensor  # N x d, every rank's rows in rank order
    z_y: torch.Tensor
    s: float  # the logit scale, 1/tau or the model's


def gather_embeddings(local: LocalForward, cfg: StreamConfig, ops: TileOps) -> Embedded:
    """Detached copies of this rank's C x d z_x, z_y, all-gathered into N x d Z_x, Z_y in rank order
    [sync 1] (as `ops` reads them: the kernels read bf16 as it is), and the scale s."""
    z_x = torch.cat([out[0].detach() for out in local.outputs])
    z_y = torch.cat([out[1].detach() for out in local.outputs])
    s = 1.0 / cfg.tau if cfg.tau is not None else _float(local.outputs[0][2])
    all_x, all_y = (ops.prepare(z) for z in gather_pairs(z_x, z_y, cfg.n, cfg.group, upcast=False))
    if all_x.dtype != all_y.dtype:  # the two towers' dtypes differ: both in the compute dtype
        dtype = compute_dtype(all_x.dtype, all_y.dtype)
        all_x, all_y = all_x.to(dtype), all_y.to(dtype)
    return Embedded(all_x, all_y, s)


# Phase 2: the normalisers a, b and the loss.


@dataclass
class Normalisers:
    """Phase 2's result: what phase 3 needs, and the loss."""

    a: torch.Tensor  # N row LSEs
    b: torch.Tensor  # N column LSEs
    diag_coef: torch.Tensor  # R_ii + Q_ii - 2 for this rank's C pairs
    loss: float


def phase2_normalisers(emb: Embedded, cfg: StreamConfig, ops: TileOps) -> Normalisers:
    """a, b over the whole global batch, and L = 1/(2N) sum_i (nll_x_i + nll_y_i), where
    nll_x_i = a_i - S_ii = -log R_ii and nll_y_i = b_i - S_ii = -log Q_ii (autocast off, `ops`'s precision)."""
    own = slice(cfg.offset, cfg.offset + cfg.local)
    with pinned(ops.precision, emb.z_x.device.type):
        if cfg.normalisers == "replicated":
            a, nll_x, b, nll_y = ops.both_lse(emb.z_x, emb.z_y, emb.s)
            nll_x, nll_y, total = nll_x[own], nll_y[own], (nll_x + nll_y).sum()
        else:
            a_own, nll_x, b_own, nll_y = own_normalisers(emb, cfg, ops)
            # One tiny all-gather: my a's, my b's and my share of the loss (2C + 1 floats per rank).
            mine = torch.cat((a_own, b_own, (nll_x + nll_y).sum().unsqueeze(0)))
            every = mine.new_empty(cfg.world * len(mine))
            all_gather_counted(every, mine, cfg.group, "normalisers")
            every = every.view(cfg.world, len(mine))
            a, b = every[:, : cfg.local].reshape(-1), every[:, cfg.local : 2 * cfg.local].reshape(-1)
            total = every[:, -1].sum()  # the same numbers in the same order on every rank
    # R_ii + Q_ii - 2 = expm1(-nll_x) + expm1(-nll_y): no cancellation of two numbers near 2.
    return Normalisers(a, b, torch.expm1(-nll_x) + torch.expm1(-nll_y), (total / (2 * cfg.n)).item())


def own_normalisers(emb: Embedded, cfg: StreamConfig, ops: TileOps) -> tuple[torch.Tensor, ...]:
    """The sharded phase 2's tile work: my rows' a and nll_x (my rows of S), my columns' b and nll_y (my rows
    of S^T); 2 C N d multiply-adds."""
    own = slice(cfg.offset, cfg.offset + cfg.local)
    if ops.name == "torch":  # the own block S[own, own] made once for both (`own_block`)
        return own_lse(emb.z_x, emb.z_y, emb.s, own, ops)
    a_own, nll_x = ops.row_lse(emb.z_x[own], emb.z_y, emb.s, cfg.offset)
    b_own, nll_y = ops.row_lse(emb.z_y[own], emb.z_x, emb.s, cfg.offset)
    return a_own, nll_x, b_own, nll_y


# Phase 3: a micro-batch's G.


def phase3_embedding_grads(
    emb: Embedded, norm: Normalisers, rows: slice, cfg: StreamConfig, needs: tuple[bool, ...], ops: TileOps
) -> tuple[Any, Any, Any]:
    """(G_x, G_y, this micro-batch's share of dL/ds) for local `rows`, by `ops` (autocast off, its
    precision). `needs` says which of z_x, z_y, s require grad; what is not needed is None and not computed
    (G_x is computed for dL/ds even when z_x needs none)."""
    glob = slice(cfg.offset + rows.start, cfg.offset + rows.stop)
    coef, scale = norm.diag_coef[rows], emb.s / (2 * cfg.n)
    g_x = g_y = g_s = None
    with pinned(ops.precision, emb.z_x.device.type):
        if ops.name == "torch" and (needs[0] or needs[2]) and needs[1]:  # S[glob, glob] made once (`own_block`)
            g_x, g_y = block_pair_products(emb.z_x, emb.z_y, emb.s, (norm.a, norm.b), coef, glob, ops)
            g_x, g_y = g_x.mul_(scale), g_y.mul_(scale)
        elif needs[0] or needs[2]:
            pairing = Pairing(norm.a[glob], norm.b, coef, glob.start)
            g_x = ops.pair_product(emb.z_x[glob], emb.z_y, emb.s, pairing).mul_(scale)
        if needs[1] and g_y is None:
            pairing = Pairing(norm.b[glob], norm.a, coef, glob.start)
            g_y = ops.pair_product(emb.z_y[glob], emb.z_x, emb.s, pairing).mul_(scale)
        if needs[2]:
            g_s = (emb.z_x[glob] * g_x).sum() / emb.s  # dL/ds = (1/s) sum_i z_i^x . G_x,i
    return (g_x if needs[0] else None), g_y, g_s


def _shared_grads(shares, rows: slice, last: bool, needs: tuple) -> tuple:
    """A micro-batch's slice of the rank's shares: G for its rows, and the rank's dL/ds, dL/dbeta share
    once, with the last micro-batch (s and beta are parameters every micro-batch's graph reaches; the
    last backward is the one the wrapper reduces in, so every parameter must take part in it)."""
    grads = (shares.g_x[rows], shares.g_y[rows], shares.g_s if last else None, shares.g_b if last else None)
    return tuple(g if need else None for g, need in zip(grads, needs))


# Phase 4: the micro-batch's outputs with a graph, and the VJP of m G into them (phase 5 reduces in the last).


def phase4_outputs(wrapped: Wrapped, x: Any, y: Any, local: LocalForward, k: int) -> safeguards.Outputs:
    """Micro-batch k's (z_x, z_y, s or None) with the graph phase 4 back-propagates into: the kept
    outputs (one forward), or a recompute under the random state phase 1 saved (the same masks)."""
    if local.kept:
        return local.outputs[k]
    with local.rng[k]:
        return safeguards.as_outputs(wrapped.model(x, y))


def needs_of(outputs: safeguards.Outputs) -> tuple[bool, ...]:
    """Which of (z_x, z_y, s, beta) carry a graph to trainable parameters. Read from the outputs: a frozen
    encoder's embedding can still depend on trainable parameters outside it (open_clip's
    text_projection and ln_final sit on the model, not in a text module)."""
    return tuple(z is not None and z.requires_grad for z in outputs)


def phase4_backward(outputs: safeguards.Outputs, grads: tuple, multiplier: torch.Tensor) -> None:
    """The micro-batch's VJP: backward of m <(z_x, z_y, s), (G_x, G_y, dL/ds)> into `outputs`' graph,
    each gradient in its output's dtype (m: the wrapper's reduction factor, times a GradScaler's)."""
    pairs = [(z, g) for z, g in zip(outputs, grads) if g is not None]
    if pairs:  # d(m <z, g>)/dz = m g exactly: the surrogate's backward without forming it
        torch.autograd.backward(
            [z for z, _ in pairs], [(g * multiplier).to(z.dtype).reshape(z.shape) for z, g in pairs]
        )


# Who does the tile work; and the step without the encoders, beside it.


def step_tile_ops(cfg: StreamConfig, z_x: torch.Tensor, z_y: torch.Tensor) -> TileOps:
    """Who does this step's tile work (KERNELS, MATMUL_PRECISION) for embeddings like z_x, z_y, and its T:
    STREAM_CHUNK_SIZE, or the default for this device and shape (`chunk_size`)."""
    dtype = compute_dtype(z_x.dtype, z_y.dtype)
    t = cfg.t or chunk_for(cfg, z_x.device, dtype)
    ops = tile_ops(cfg.kernels, cfg.precision, t, z_x.device, dtype, z_x.shape[1], cfg.w_budget)
    if ops.name == "torch":
        warn_if_many_launches(cfg, t, z_x.device, dtype)
    return ops


def loss_machinery(
    z_x: torch.Tensor, z_y: torch.Tensor, config: Mapping[str, Any], logit_bias: float | None = None
) -> tuple[float, Any, Any]:
    """The step without the encoders, for benchmarks and notebooks: this rank's C x d embeddings in,
    (L, G_x, G_y) for its rows out, by the path the step takes (TAU is required; no guards). InfoNCE
    gathered: the all-gather, phase 2, phase 3 over every micro-batch; a `logit_bias` (the sigmoid
    loss) or EXCHANGE "ring": `exchange.rank_shares` for the rank's C rows."""
    cfg = parse_config(config, dist.get_world_size(), dist.get_rank())
    if (problem := kernels_problem(cfg.kernels, z_x.device)) is not None:
        raise ValueError(problem)
    ops = step_tile_ops(cfg, z_x, z_y)
    if logit_bias is not None or cfg.exchange == "ring":
        logits = Logits(1.0 / cfg.tau, logit_bias) if logit_bias is not None else 1.0 / cfg.tau
        shares, loss = rank_shares(z_x, z_y, logits, cfg.exchange, ops)
        return loss, shares.g_x, shares.g_y
    emb = gather_embeddings(LocalForward([slice(0, len(z_x))], [(z_x, z_y, None)], [], kept=False), cfg, ops)
    norm = phase2_normalisers(emb, cfg, ops)
    grads = [phase3_embedding_grads(emb, norm, rows, cfg, (True, True, False), ops)[:2] for rows in cfg.micro]
    return norm.loss, torch.cat([g[0] for g in grads]), torch.cat([g[1] for g in grads])


def _float(t: torch.Tensor) -> float:
    return float(t.detach().double().reshape(()))
