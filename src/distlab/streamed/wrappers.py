"""The streamed step's wrappers: the data-parallel wrapper (DDP, torch.compile(DDP), FSDP2), BatchNorm,
the device and the precision.

The step asks a wrapper five things, and `Wrapped` answers them the same way for each:

- `inner`: the caller's own module, whose parameters say what is trainable (DDP: `ddp.module`;
  compiled DDP: `compiled._orig_mod.module`; FSDP2: the model itself, since `fully_shard` changes a
  module's class in place and leaves its attributes where they were).
- `group`: the process group the wrapper reduces over, which the step gathers over too (DDP's
  `process_group`, the world unless given; FSDP2: its one 1-D mesh's group). The global batch N is
  that group's: two DDP subgroups train two independent contrastive batches.
- `no_grad_forward`: what phase 1 calls without grad. DDP: its module, skipping DDP's bookkeeping
  and buffer broadcast; compiled DDP and FSDP2: the model itself (FSDP2 must all-gather the
  parameters, and the compiled model must draw the same dropout masks as its recompute).
- `accumulating(reduce)`: every micro-batch but the last runs with the wrapper's gradient
  reduction off (DDP `no_sync()`, FSDP2 `set_requires_gradient_sync(False)`), so the gradients are
  reduced once, in the last backward. With `reduce=True` the caller's own setting is left alone:
  a call made inside the caller's `no_sync()` does not reduce at all (gradient accumulation).
- `reduction_factor`: what the wrapper divides the summed gradient by. DDP averages over its
  process group (P). FSDP2 divides by its gradient divide factor, which is the data-parallel size
  unless `set_gradient_divide_factor` changed it. The step scales its surrogate by this factor,
  so that the wrapper's reduction of the ranks' VJPs is their sum: the global gradient.

Precision. Under `torch.autocast` the towers run in bf16 (or fp16), and their embeddings may come out
in bf16, or in float32 (a tower ending in `.float()` or a LayerNorm); the two towers may differ. The
step computes a, b, the loss, G and dL/ds in float32, or in float64 when either embedding is float64
(`compute_dtype`), with autocast off: bf16 logits would round s z_x . z_y (about 14 at tau = 0.07) to
a step of 0.06, and the loss (4.6452) to 4.625. It gathers each embedding in its own dtype when the
two agree (bf16 halves the bytes on the wire) and upcasts after (exact), and hands G back in each
embedding's own dtype, as autograd would. Measured (tests/test_streamed_wrappers.py: bf16 autocast on
CPU, P = 2, N = 64): the whole gradient is 3.9e-3 (relative) from the float32 model's, against
4.3e-3 to 4.9e-3 for plain autograd under the same autocast (which rounds its logits to bf16).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

SUPPORTED = "DistributedDataParallel, torch.compile(DistributedDataParallel(model)), or FSDP2 (fully_shard)"


def _compiled_inner(model: Any) -> Any:
    """The module torch.compile wrapped, or None when `model` was not compiled."""
    from torch._dynamo.eval_frame import OptimizedModule

    return model._orig_mod if isinstance(model, OptimizedModule) else None


def _fsdp_groups(model: nn.Module) -> list:
    """Every FSDP2 parameter group under `model` (one per `fully_shard` call that owns parameters)."""
    return [
        group
        for module in model.modules()
        if isinstance(module, FSDPModule)
        for group in module._get_fsdp_state()._fsdp_param_groups
    ]


@dataclass(frozen=True)
class Wrapped:
    """The caller's model and the parts of it the step uses (see the module docstring)."""

    model: nn.Module
    kind: str  # "ddp", "compiled ddp" or "fsdp2"
    inner: nn.Module
    no_grad_forward: Callable[..., Any]

    @property
    def reduction_factor(self) -> float:
        if self.kind == "fsdp2":
            factors = set()
            for group in _fsdp_groups(self.model):
                size = group.mesh_info.mesh.size()
                factors.add(float(group.gradient_divide_factor or size))
            if len(factors) > 1:
                raise ValueError(
                    f"FSDP2 modules divide gradients by different factors {sorted(factors)}: "
                    "the step can scale its surrogate for one factor only"
                )
            return factors.pop() if factors else 1.0
        ddp = self.model if self.kind == "ddp" else _compiled_inner(self.model)
        return float(ddp.process_group.size())

    @property
    def group(self) -> Any:
        """The process group the wrapper averages the gradients over (see the module docstring)."""
        if self.kind != "fsdp2":
            return (self.model if self.kind == "ddp" else _compiled_inner(self.model)).process_group
        meshes = [group.mesh_info.mesh for group in _fsdp_groups(self.model)]
        if not meshes:
            return dist.group.WORLD
        if any(mesh != meshes[0] for mesh in meshes) or meshes[0].ndim != 1:
            raise ValueError(
                "FSDP2 over a 2-D device mesh (HSDP) or over different meshes: the step gathers "
                "and scales over one process group; shard every module on one 1-D mesh"
            )
        return meshes[0].get_group()

    @property
    def static_graph(self) -> bool:
        """DDP(static_graph=True), whose reducer cannot run a backward under no_sync()."""
        ddp = self.model if self.kind == "ddp" else _compiled_inner(self.model) if self.kind == "compiled ddp" else None
        return bool(getattr(ddp, "static_graph", False))

    def accumulating(self, reduce: bool) -> AbstractContextManager:
        """Gradient reduction off for this backward unless `reduce` (then the caller's setting holds)."""
        if reduce:
            return nullcontext()
        if self.kind == "fsdp2":
            return _fsdp_no_sync(self.model)
        ddp = self.model if self.kind == "ddp" else _compiled_inner(self.model)
        return ddp.no_sync()


@contextmanager
def _fsdp_no_sync(model: nn.Module) -> Iterator[None]:
    """FSDP2's `set_requires_gradient_sync(False)`, restoring each group's own setting afterwards."""
    groups = _fsdp_groups(model)
    saved = [(g.reduce_grads, g.all_reduce_grads) for g in groups]
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        for group, (reduce_grads, all_reduce_grads) in zip(groups, saved):
            group.reduce_grads, group.all_reduce_grads = reduce_grads, all_reduce_grads


def unwrap(model: Any) -> Wrapped:
    """Recognise the wrapper; ValueError (the same on every rank) for anything else."""
    compiled = _compiled_inner(model)
    if isinstance(model, DistributedDataParallel):
        return Wrapped(model, "ddp", model.module, model.module)
    if isinstance(compiled, DistributedDataParallel):
        return Wrapped(model, "compiled ddp", compiled.module, model)
    if isinstance(model, FSDPModule):
        return Wrapped(model, "fsdp2", model, model)
    what = f"torch.compile({type(compiled).__name__})" if compiled is not None else type(model).__name__
    raise ValueError(
        f"model must be wrapped in {SUPPORTED}, got {what}: the wrapper's gradient "
        "reduction is the step's second sync point"
    )


def trainable(module: nn.Module) -> bool:
    return any(p.requires_grad for p in module.parameters())


def batchnorm_in_training(module: nn.Module) -> list[str]:
    """Names of the BatchNorm layers (SyncBatchNorm included) that are in training mode."""
    return [
        name or type(m).__name__
        for name, m in module.named_modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training
    ]


def batchnorm_snapshot(module: nn.Module) -> Callable[[], None]:
    """Copies of the buffers of every BatchNorm in training mode (running statistics and
    num_batches_tracked; a few numbers per channel), and a function that puts them back, so that a
    step refused after its forward leaves no trace of that forward."""
    saved = [
        (buf, buf.clone())
        for m in module.modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training
        for buf in m.buffers(recurse=False)
    ]

    def restore() -> None:
        with torch.no_grad():
            for buf, copy in saved:
                buf.copy_(copy)

    return restore


def first_device(module: nn.Module | None, fallback: Any) -> torch.device:
    """Where the step's small exchange runs: the parameters' device (on GPUs the nccl side of the
    group), else the batch's."""
    for p in module.parameters() if module is not None else ():
        return p.device
    return fallback.device if isinstance(fallback, torch.Tensor) else torch.device("cpu")


def compute_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """float64 if any embedding is float64, else float32 (bf16, fp16 and float32 all compute in it)."""
    return torch.float64 if torch.float64 in dtypes else torch.float32


def surrogate_multiplier(reduction_factor: float, grad_scaler, like: torch.Tensor) -> torch.Tensor:
    """The factor every VJP is multiplied by: the wrapper's reduction factor (its average becomes
    the sum over ranks), times the GradScaler's scale when one is given (scaler.scale(loss) would
    have multiplied the loss by it). A 0-dim tensor in `like`'s dtype and device."""
    factor = torch.full((), reduction_factor, dtype=like.dtype, device=like.device)
    if grad_scaler is not None:
        factor = grad_scaler.scale(factor).to(like.dtype)
    return factor
