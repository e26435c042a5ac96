"""`ClipLoss` and `SigLipLoss`: the streamed step's exact global loss as a loss module, where open_clip's
trainer, a Hugging Face loop or Lightning plug a loss.

    loss = ClipLoss(rank=rank, world_size=world_size)(image_features, text_features, logit_scale)
    loss.backward()                                                  # DDP or FSDP2 reduces as always

Called as open_clip's losses are, `loss(image_features, text_features, logit_scale, logit_bias=None,
output_dict=False)`, with this rank's C x d features, it returns the loss of the *global* batch of N = C P
pairs (the same number on every rank; `{"contrastive_loss": L}` with output_dict=True): the symmetric
InfoNCE (`ClipLoss`) or the sigmoid loss (`SigLipLoss`). The forward is a custom autograd function that
exchanges detached copies of the features (EXCHANGE "gather": one all-gather, every rank holds N x 2d;
"ring": C x d blocks pass rank to rank), computes L in T x T tiles and, in the same pass, this rank's
closed-form gradients (`distlab.streamed.step` phases 2 and 3, `exchange.rank_shares`):

    G_x = dL/dZ_x and G_y = dL/dZ_y for this rank's C rows, its share of dL/ds, of dL/dbeta

(the shares of dL/ds and dL/dbeta add up over the ranks to the whole derivative). Nothing C x N is made.
The backward hands back m g G for each input, g the incoming gradient (1, or a GradScaler's scale) and m
the wrapper's reduction factor: DDP and FSDP2 average the ranks' parameter gradients, dividing their
sum by m (= P, or FSDP2's gradient divide factor: `gradient_divide_factor`), so the reduction of
m G_r dz_r/dtheta is sum_r G_r dz_r/dtheta = dL/dtheta, every parameter's whole-batch gradient, the
scale's and the bias's included. This is the surrogate the step uses (its phase 4's VJP of m G), and the
gradient open_clip's `ClipLoss(local_loss=True, gather_with_grad=True)` and `SigLipLoss` produce. A loss
added beside it (CoCa's captioning term, distillation, a regulariser) is differentiated and averaged as
usual: its gradient is DDP's mean over the ranks of its own, as it would be without this module.

It holds the towers' activations of all C pairs from forward to backward, as any loss module does
(`distributed_backward` with B < C recomputes micro-batches instead). It is exact under autocast as the
step is: the loss and G in float32 (float64 for float64 features), G handed back in each feature's dtype.
What it cannot do exactly it refuses, the same error on every rank before any exchange (`safeguards.loss_call`),
and every error ends with the reminder to call `release_process_group()` before exiting. Features that
are not finite give a loss and gradients that are not finite, as any loss would (a GradScaler skips the
step). Without a process group and with world_size=1 it computes the loss of its own batch, with no
exchange.

In a practitioner's loop. Under torch.no_grad() (a validation loop), or when no input requires grad, it
computes the loss alone (`loss_alone`: the InfoNCE's phases 1-2 without phase 3, the gathered sigmoid loss
with S made once), the same number. Every call's place is agreed across ranks before the exchange (which
module, its call count, the grad mode: `safeguards.loss_call`), so a loss called on some ranks only ends on every rank
naming the calls instead of exchanging features of different batches or hanging. A second backward through one
call is a clear RuntimeError: the first hands its gradients out and frees them.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.function import once_differentiable

from distlab.streamed.config import REQUIRED, StreamConfig, parse_config
from distlab.streamed.exchange import rank_shares, sigmoid_gathered
from distlab.streamed.safeguards import Call, agree, as_number, hinting_release, local_problem
from distlab.streamed.sigmoid import Logits
from distlab.streamed.step import (
    Embedded,
    LocalForward,
    gather_embeddings,
    phase2_normalisers,
    phase3_embedding_grads,
    step_tile_ops,
)
from distlab.streamed.wrappers import compute_dtype

DEFAULT_T = 1024  # T when STREAM_CHUNK_SIZE is required and none is given: 4 MiB float32 tiles
DIST_IMPLS = ("bidir", "shift", "reduce", "gather")  # open_clip's SigLipLoss exchanges


def check_open_clip_arg(key: str, value: Any) -> None:
    """open_clip's constructor arguments that change nothing here, each checked as open_clip would take it:
    local_loss and gather_with_grad (open_clip's choice of gradient recipe; this module's is always the
    exact one), cache_labels (no labels are made), and SigLipLoss's bidir, dist_impl (how open_clip's text
    blocks travel) and chunk_size (how it cuts its logits)."""
    if key in ("local_loss", "gather_with_grad", "cache_labels", "bidir"):
        ok, wanted = isinstance(value, bool), "True or False"
    elif key == "dist_impl":
        ok, wanted = value is None or value in DIST_IMPLS, f"None or one of {DIST_IMPLS}"
    else:  # chunk_size
        ok, wanted = isinstance(value, int) and not isinstance(value, bool) and value >= 0, "an int >= 0"
    if not ok:
        raise ValueError(f"{key} must be {wanted}, got {value!r}")


class StreamedContrastiveLoss(nn.Module):
    """What `ClipLoss` and `SigLipLoss` share: the settings, the checks, the call."""

    sigmoid = False  # the loss: the symmetric InfoNCE, or (SigLipLoss) the sigmoid loss
    exchanging = 0  # loss modules of this process that have exchanged: numbered in the order of their first call
    accepts = ("local_loss", "gather_with_grad", "cache_labels")  # open_clip's own arguments, by name

    def __init__(
        self,
        *,
        exchange: str = "gather",
        stream_chunk_size: int | None = None,
        kernels: str = "auto",
        matmul_precision: str = "float32",
        group: Any = None,
        gradient_divide_factor: float | None = None,
        **open_clip_args: Any,
    ):
        super().__init__()
        name = type(self).__name__
        # open_clip's args.rank and args.world_size, by name as open_clip's own losses take them
        rank, world_size = open_clip_args.pop("rank", 0), open_clip_args.pop("world_size", 1)
        if open_clip_args.pop("use_horovod", False):
            raise ValueError(f"{name}(use_horovod=True): this loss exchanges over torch.distributed only")
        for key, value in open_clip_args.items():
            if key not in self.accepts:
                raise TypeError(f"{name} got an unexpected keyword argument {key!r}; it takes {self.signature()}")
            check_open_clip_arg(key, value)
        for key, value in (("rank", rank), ("world_size", world_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < (key == "world_size"):
                raise ValueError(f"{key} must be an int (open_clip's args.{key}), got {value!r}")
        if gradient_divide_factor is not None and not (
            isinstance(gradient_divide_factor, numbers.Real) and gradient_divide_factor > 0
        ):
            raise ValueError(f"gradient_divide_factor must be a number > 0, got {gradient_divide_factor!r}")
        self.claimed = (rank, world_size)  # checked against the process group at the first call
        self.settings = {"EXCHANGE": exchange, "STREAM_CHUNK_SIZE": stream_chunk_size}
        if stream_chunk_size is None and "STREAM_CHUNK_SIZE" in REQUIRED:
            self.settings["STREAM_CHUNK_SIZE"] = DEFAULT_T
        elif stream_chunk_size is None:
            del self.settings["STREAM_CHUNK_SIZE"]  # the machinery chooses T
        if kernels != "auto":
            self.settings["KERNELS"] = kernels  # the machinery's default is "auto"
        # The step's default, "float32": exact to float32 rounding, and on CUDA the torch tiles (cuBLAS). "bf16" or
        # "tf32" let KERNELS "auto" take the Triton kernels (README, "Tiles and kernels": error and time of each).
        self.settings["MATMUL_PRECISION"] = matmul_precision
        self.group, self.gradient_divide_factor = group, gradient_divide_factor
        self.number, self.calls = 0, 0  # which module, its calls: agreed across ranks at every call (`safeguards`)
        self.config(1, 1, 0)  # the settings, checked by the step's own config parsing: the same on every rank

    @classmethod
    def signature(cls) -> str:
        return (
            "rank, world_size, exchange, stream_chunk_size, kernels, matmul_precision, group, gradient_divide_factor, "
            "and "
            f"open_clip's {', '.join(cls.accepts)}, use_horovod=False"
        )

    def config(self, c: int, world: int, rank: int, local: bool = False) -> StreamConfig:
        """The step's config for C pairs per rank: N = C P, one micro-batch (B = C), these settings."""
        extra = {"NORMALISERS": "replicated"} if local else {}  # no process group: no exchange at all
        config = {"GLOBAL_BATCH_SIZE": c * world, "MICRO_BATCH_SIZE": c, **self.settings, **extra}
        return parse_config(config, world, rank, None if local else self.group)

    @torch.compiler.disable  # Python collectives and tiles: nothing for a compiler to trace
    def forward(
        self,
        image_features: torch.Tensor,
        text_features: torch.Tensor,
        logit_scale: torch.Tensor | float,
        logit_bias: torch.Tensor | float | None = None,
        output_dict: bool = False,
    ) -> torch.Tensor | Mapping[str, torch.Tensor]:
        """The global batch's loss from this rank's C x d features (open_clip's call); its backward hands
        each input m g times this rank's share of the whole batch's gradient (see the module docstring)."""
        with hinting_release():
            cfg = self._checked(image_features, text_features, logit_scale, logit_bias)
            scale = logit_scale if isinstance(logit_scale, torch.Tensor) else torch.tensor(float(logit_scale))
            bias = (
                logit_bias if logit_bias is None or isinstance(logit_bias, torch.Tensor) else torch.tensor(logit_bias)
            )
            inputs = (image_features, text_features, scale, bias)
            if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs):
                factor = self.gradient_divide_factor or float(cfg.world)  # m: what the wrapper divides the sum by
                loss = StreamedLossFunction.apply((cfg, self.sigmoid, factor), *inputs)
            else:  # torch.no_grad() (a validation loop): the loss alone, no gradient computed or kept
                loss = loss_alone(cfg, self.sigmoid, *inputs)
        return {"contrastive_loss": loss} if output_dict else loss

    def _checked(self, z_x: Any, z_y: Any, s: Any, beta: Any) -> StreamConfig:
        """The call's config once every rank agreed to it, or the same ValueError on every rank."""
        exchange, t = self.settings["EXCHANGE"], self.settings.get("STREAM_CHUNK_SIZE", 0)
        if not (dist.is_available() and dist.is_initialized()):
            call = Call(z_x, z_y, s, beta, exchange, t, self.group)
            if self.claimed != (0, 1):
                raise ValueError(
                    f"{type(self).__name__}(rank={self.claimed[0]}, world_size={self.claimed[1]}) needs an initialised "
                    "process group (torch.distributed.init_process_group); without one only world_size=1 runs"
                )
            problem = local_problem(call, self.claimed, self.sigmoid, place=(0, 1))
            if problem is not None:
                raise ValueError(problem)
            return self.config(z_x.shape[0], 1, 0, local=True)
        if self.number == 0:  # its first exchange: the next number (a module called on rank 0 only gets one there)
            StreamedContrastiveLoss.exchanging += 1
            self.number = StreamedContrastiveLoss.exchanging
        self.calls += 1
        call = Call(z_x, z_y, s, beta, exchange, t, self.group, self.number, self.calls)
        agree(call, local_problem(call, self.claimed, self.sigmoid))
        return self.config(z_x.shape[0], dist.get_world_size(self.group), dist.get_rank(self.group))


class ClipLoss(StreamedContrastiveLoss):
    """open_clip's `ClipLoss` with the exact global gradient whatever `local_loss` and `gather_with_grad`
    say (the gradient open_clip gives with both True). A logit_bias, which open_clip's ClipLoss adds to
    every logit, leaves a softmax unchanged: its gradient is exactly 0."""


class SigLipLoss(StreamedContrastiveLoss):
    """open_clip's `SigLipLoss`: the sigmoid loss of the global batch, with its bias beta (required).
    `dist_impl` and `bidir` (how open_clip's text blocks travel) and `chunk_size` (how open_clip cuts
    its logits) change nothing here; `exchange` and `stream_chunk_size` choose this module's way."""

    sigmoid = True
    accepts = ("cache_labels", "dist_impl", "bidir", "chunk_size")


def rank_gradients(z_x, z_y, s: float, beta: float | None, cfg: StreamConfig, needs) -> tuple[float, list]:
    """(L, [G_x, G_y, this rank's dL/ds share, its dL/dbeta share]) for this rank's detached C x d features,
    by the step's own machinery (its tile work: KERNELS, MATMUL_PRECISION, T, as the step chooses them);
    what `needs` (z_x, z_y, s, beta) does not ask for may be None."""
    ops = step_tile_ops(cfg, z_x, z_y)
    if cfg.group is None and cfg.world == 1 and not dist.is_initialized():  # no process group: one process
        z_x, z_y = ops.prepare(z_x), ops.prepare(z_y)
        if z_x.dtype != z_y.dtype:
            dtype = compute_dtype(z_x.dtype, z_y.dtype)
            z_x, z_y = z_x.to(dtype), z_y.to(dtype)
        if beta is not None:
            shares = sigmoid_gathered(z_x, z_y, Logits(s, beta), slice(0, len(z_x)), ops, want_grads=any(needs))
            return shares.loss_part.item(), [shares.g_x, shares.g_y, shares.g_s, shares.g_b]
        emb = Embedded(z_x, z_y, s)
    elif beta is not None or cfg.exchange == "ring":
        logits = Logits(s, beta) if beta is not None else s
        shares, loss = rank_shares(z_x, z_y, logits, cfg.exchange, ops, cfg.group, want_grads=any(needs))
        return loss, [shares.g_x, shares.g_y, shares.g_s, shares.g_b]
    else:  # as the step's gather_embeddings: gathered as they are, then read as `ops` reads them
        emb = gather_embeddings(
            LocalForward([slice(0, len(z_x))], [(z_x, z_y, torch.tensor(s, dtype=torch.float64))], [], kept=False),
            cfg,
            ops,
        )
    norm = phase2_normalisers(emb, cfg, ops)
    if not any(needs[:3]):
        return norm.loss, [None, None, None, None]
    grads = phase3_embedding_grads(emb, norm, slice(0, cfg.local), cfg, tuple(needs[:3]), ops)
    return norm.loss, [*grads, None]


def loss_alone(cfg: StreamConfig, sigmoid: bool, z_x, z_y, s, beta) -> torch.Tensor:
    """The global loss with no gradient work (under torch.no_grad(), or when no input requires grad): the
    InfoNCE through phase 2 only (phase 3's G never runs), the gathered sigmoid loss with S made once; the
    same number the forward with gradients gives."""
    loss, _ = rank_gradients(
        z_x.detach(), z_y.detach(), as_number(s), as_number(beta) if sigmoid else None, cfg, (False,) * 4
    )
    return torch.tensor(loss, dtype=compute_dtype(z_x.dtype, z_y.dtype), device=z_x.device)


class StreamedLossFunction(torch.autograd.Function):
    """Forward: the global loss, and this rank's gradients kept for the backward. Backward: m g G."""

    @staticmethod
    def forward(ctx, plan, z_x, z_y, s, beta):
        cfg, sigmoid, factor = plan
        needs = ctx.needs_input_grad[1:5]
        loss, grads = rank_gradients(
            z_x.detach(), z_y.detach(), as_number(s), as_number(beta) if sigmoid else None, cfg, needs
        )
        if not sigmoid and beta is not None:
            grads[3] = torch.zeros((), dtype=torch.float64)  # a constant added to every logit: dL/dbeta = 0
        ctx.grads, ctx.factor = grads, factor
        ctx.likes = [(t.dtype, t.shape, t.device) if t is not None else None for t in (z_x, z_y, s, beta)]
        return torch.tensor(loss, dtype=compute_dtype(z_x.dtype, z_y.dtype), device=z_x.device)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss):
        if ctx.grads is None:  # handed out by the first backward, and freed (they are C x d each)
            raise RuntimeError(
                "a second backward through one call of the streamed loss module: its gradients were handed out by "
                "the first and freed (as autograd frees a graph without retain_graph=True); call the loss again "
                "for another backward"
            )
        out = [None]  # the plan
        for g, like, need in zip(ctx.grads, ctx.likes, ctx.needs_input_grad[1:5]):
            if not need or g is None:
                out.append(None)
                continue
            dtype, shape, device = like
            m_g = grad_loss.to(device=g.device, dtype=g.dtype) * ctx.factor  # g: the incoming gradient
            out.append((g * m_g).to(device=device, dtype=dtype).reshape(shape))
        ctx.grads = None
        return tuple(out)
