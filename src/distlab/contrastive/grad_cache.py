"""GradCache: the exact gradient of a contrastive loss over a batch far larger than fits in memory.

Gao, Zhang, Han and Callan, "Scaling Deep Contrastive Learning Batch Size under Memory Limited Setup"
(RepL4NLP 2021, https://arxiv.org/abs/2101.06983); reference library luyug/GradCache
(https://github.com/luyug/GradCache), whose interface this class keeps.

A contrastive loss L(h_1 .. h_n) over the n samples one call sees (n = N in one process, C = N/P on
a rank under DDP) couples every sample to every other, so it cannot be cut into
micro-batches whose gradients add up. But the parameters theta reach L only through the
representations h_i = f_theta(x_i), and those are small (n x d). The chain rule splits the work:

    dL/dtheta = sum_i (dL/dh_i) . (dh_i/dtheta)

1. `forward_no_grad`: run the model over the batch in micro-batches of B samples (the chunk size)
   *without* a graph and keep only the representations H (n x d). Memory: one micro-batch's
   activations at a time.
2. `build_cache`: compute L(H) on detached leaves, backward to the leaves: the cache G = dL/dH (n x d).
   The model is not involved; this costs the loss alone (its n x n logits included).
3. `forward_backward`: for every micro-batch again, recompute h = f_theta(x_chunk) *with* a graph and
   back-propagate the surrogate <h, G_chunk> (the dot product over all entries), whose gradient is
   G_chunk . dh/dtheta, and the micro-batches' gradients add up to dL/dtheta exactly.

Step 3 recomputes step 1, so anything random in the model (dropout) must draw the same numbers both
times, or the gradient belongs to a different function than the loss. Step 1 snapshots the random
state before each micro-batch in a `RandContext` (CPU and every CUDA device the chunk lives on) and
step 3 replays it. The cost: one extra forward per step, about 4/3 of a plain step when backward ~ 2
forward. Two readings of the method that do not hold: with B = n it is *not* plain training (every
sample still runs twice), and its memory is *not* that of B samples (the loss's n x n logits remain,
whatever B; lesson 25 removes them).

Under DDP every rank caches its own C = N/P samples in micro-batches of B; the loss gathers the
representations of all ranks with a gather whose backward sums over ranks (lesson 23), so G holds
sum_r dL_r/dH_local, and DDP's average of the parameter gradients is d(mean_r L_r)/dtheta, the global
batch's gradient. `no_sync_except_last=True` turns off DDP's all-reduce for every micro-batch but the
last, where the accumulated gradient is reduced once. A model that appears twice in `models` (one
tower for both sides) is reduced once too: only its last micro-batch of its last use synchronises.

Mixed precision: `precision="fp16"` runs the model under float16 autocast and needs a GradScaler; the
cache is the *scaled* loss's gradient, so the parameter gradients come out scaled and the caller does
`scaler.step(optimizer); scaler.update()` as usual. `precision="bf16"` runs under bfloat16 autocast and
needs no scaler (float32's exponent range). In both, the loss sees the representations upcast to float32.

The interface is luyug/GradCache's: GradCache(models, chunk_sizes, loss_fn, split_input_fn,
get_rep_fn, precision, scaler), split_inputs, get_input_tensors, model_call, get_reps, compute_loss,
forward_no_grad, build_cache, forward_backward, cache_step(*inputs, no_sync_except_last,
**loss_kwargs) -> loss, and __call__ = cache_step. Where ours differs:
- `precision` ("float32", "fp16" or "bf16") in the place of the library's `fp16` flag, so bfloat16 is
  one more value, not another switch;
- the surrogate is taken in float32 *or wider*: the library casts it to float32, which costs a
  float64 run its exactness;
- the cache is cut by the rows each micro-batch actually produced, not by chunk_size, so a custom
  split_input_fn may cut unevenly;
- dict values of unequal length and VLM patch counts are refused, where zip() would silently drop
  samples; VLM dicts (pixel_values + image_grid_thw) are cut per image (`distlab.pieces.split_inputs`);
- bad input raises ValueError (an `assert` vanishes under `python -O`); autocast is
  `torch.autocast(device_type)`, so it runs on CPU as on GPU;
- a model used twice is all-reduced once under no_sync_except_last, not once per use.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from distlab.pieces.random_state import RandContext
from distlab.pieces.split_inputs import check_chunk_size, split_inputs

LOW_PRECISION = (torch.float16, torch.bfloat16)


def default_rep(model_out: Any) -> Tensor:
    """The representation in a model's output: the tensor itself; else `pooler_output`; else the
    first token of `last_hidden_state` (CLS pooling, as DPR/Tevatron); else the first element of a
    tuple or list. Attributes (HF ModelOutput) and dict keys are both looked up, with `is None`."""
    if isinstance(model_out, Tensor):
        return model_out
    for key in ("pooler_output", "last_hidden_state"):
        value = model_out.get(key) if isinstance(model_out, Mapping) else getattr(model_out, key, None)
        if value is not None:  # never `a or b`: a tensor of several elements has no truth value
            return value[:, 0] if key == "last_hidden_state" and value.dim() == 3 else value
    if isinstance(model_out, (tuple, list)) and model_out and isinstance(model_out[0], Tensor):
        return model_out[0]
    return model_out  # not a tensor: get_reps refuses it with a clear message


AMP_DTYPES = {"float32": None, "fp16": torch.float16, "bf16": torch.bfloat16}  # autocast dtype of the models


class GradCache:
    """Gradient cache over `models` (one per loss argument; the same module may appear twice).
    Optimizer steps are the caller's; gradients accumulate into `.grad` like any backward."""

    def __init__(
        self,
        models: Sequence[nn.Module],
        chunk_sizes: int | Sequence[int],
        loss_fn: Callable[..., Tensor],
        split_input_fn: Callable[[Any, int], Any] | None = None,
        get_rep_fn: Callable[[Any], Tensor] | None = None,
        precision: str = "float32",
        scaler: torch.amp.GradScaler | None = None,
    ):
        if isinstance(models, nn.Module) or not isinstance(models, (list, tuple)) or not models:
            raise ValueError(
                "models must be a non-empty list of modules, one per loss argument "
                f"(got {type(models).__name__}); for one shared tower pass [model, model]"
            )
        if not all(isinstance(m, nn.Module) for m in models):
            raise ValueError(f"every model must be an nn.Module, got {[type(m).__name__ for m in models]}")
        self.models = list(models)
        if isinstance(chunk_sizes, (list, tuple)):
            if len(chunk_sizes) != len(self.models):
                raise ValueError(
                    f"chunk_sizes has {len(chunk_sizes)} entries for {len(self.models)} "
                    "models: give one int for all, or one per model"
                )
            self.chunk_sizes = [check_chunk_size(c) for c in chunk_sizes]
        else:
            self.chunk_sizes = [check_chunk_size(chunk_sizes)] * len(self.models)
        self.loss_fn, self.split_input_fn, self.get_rep_fn = loss_fn, split_input_fn, get_rep_fn
        if precision not in AMP_DTYPES:
            raise ValueError(f"precision must be one of {sorted(AMP_DTYPES)}, got {precision!r}")
        if precision == "fp16" and scaler is None:
            raise ValueError('fp16 needs a GradScaler: GradCache(..., precision="fp16", scaler=torch.amp.GradScaler())')
        if scaler is not None and precision != "fp16":
            raise ValueError(f'a scaler is only used with precision="fp16" ({precision} needs no loss scaling)')
        self.fp16, self.scaler, self.amp_dtype = precision == "fp16", scaler, AMP_DTYPES[precision]

    def __call__(self, *model_inputs: Any, **kwargs: Any) -> Tensor:
        return self.cache_step(*model_inputs, **kwargs)

    # --- the pieces -----------------------------------------------------------------------------

    def split_inputs(self, model_input: Any, chunk_size: int) -> list:
        """Chunks of `model_input`: the user's `split_input_fn` if given, else `distlab.pieces.split_inputs`."""
        if self.split_input_fn is not None:
            return list(self.split_input_fn(model_input, chunk_size))
        try:
            return split_inputs(model_input, chunk_size)
        except ValueError as err:  # the same words, and the way out GradCache offers
            raise ValueError(f"{err} (or give GradCache a split_input_fn)") from None

    def get_input_tensors(self, model_input: Any) -> list[Tensor]:
        """Every tensor in a (nested) input: where the chunk lives, for RandContext."""
        if isinstance(model_input, Tensor):
            return [model_input]
        if isinstance(model_input, Mapping):
            model_input = list(model_input.values())
        if isinstance(model_input, (list, tuple)):
            return [t for item in model_input for t in self.get_input_tensors(item)]
        return []

    def _autocast(self, model: nn.Module):
        if self.amp_dtype is None:
            return nullcontext()
        param = next(model.parameters(), None)
        return torch.autocast(param.device.type if param is not None else "cpu", dtype=self.amp_dtype)

    def model_call(self, model: nn.Module, model_input: Any) -> Any:
        """model(x), model(*list) or model(**dict), under autocast when fp16 or bfloat16."""
        with self._autocast(model):
            if isinstance(model_input, Tensor):
                return model(model_input)
            if isinstance(model_input, (list, tuple)):
                return model(*model_input)
            if isinstance(model_input, Mapping):
                return model(**model_input)
        raise ValueError(
            f"cannot call a model on a chunk of type {type(model_input).__name__}: a "
            "split_input_fn must return tensors, lists/tuples or dicts"
        )

    def get_reps(self, model_out: Any) -> Tensor:
        reps = self.get_rep_fn(model_out) if self.get_rep_fn is not None else default_rep(model_out)
        if not isinstance(reps, Tensor) or reps.dim() == 0:
            raise ValueError(
                f"the representation must be a tensor with a sample axis, got "
                f"{type(reps).__name__}: pass get_rep_fn to pick it out of the model's output"
            )
        return reps

    def compute_loss(self, *reps: Tensor, **loss_kwargs: Any) -> Tensor:
        loss = self.loss_fn(*reps, **loss_kwargs)
        if not isinstance(loss, Tensor) or loss.numel() != 1:
            raise ValueError(
                f"loss_fn must return a scalar tensor, got {type(loss).__name__}"
                + (f" of shape {list(loss.shape)}" if isinstance(loss, Tensor) else "")
            )
        return loss

    def _forward_chunks(self, model: nn.Module, chunks: list) -> tuple[list[Tensor], list[RandContext]]:
        reps, states = [], []
        with torch.no_grad():
            for chunk in chunks:
                states.append(RandContext(model, *self.get_input_tensors(chunk)))  # before the draw
                reps.append(self.get_reps(self.model_call(model, chunk)))
        return reps, states

    def forward_no_grad(self, model: nn.Module, model_inputs: list) -> tuple[Tensor, list[RandContext]]:
        """Step 1: representations of all chunks (concatenated) and each chunk's random state."""
        reps, states = self._forward_chunks(model, model_inputs)
        return torch.cat(reps), states

    def build_cache(self, *reps: Tensor, **loss_kwargs: Any) -> tuple[list[Tensor], Tensor]:
        """Step 2: (dL/dH per model, the loss). The gradient is of the scaled loss under fp16."""
        leaves = [(r.float() if r.dtype in LOW_PRECISION else r).detach().requires_grad_() for r in reps]
        loss = self.compute_loss(*leaves, **loss_kwargs)
        (self.scaler.scale(loss) if self.fp16 else loss).backward()
        # A representation the loss ignores gets a zero gradient, not a crash on None.
        cache = [leaf.grad if leaf.grad is not None else torch.zeros_like(leaf) for leaf in leaves]
        return cache, loss.detach()

    def forward_backward(
        self,
        model: nn.Module,
        model_inputs: list,
        cached_gradients: Sequence[Tensor],
        random_states: Sequence[RandContext],
        no_sync_except_last: bool = False,
    ) -> None:
        """Step 3: recompute each chunk with its replayed random state; backward <h, g>."""
        if not len(model_inputs) == len(cached_gradients) == len(random_states):
            raise ValueError(
                f"{len(model_inputs)} chunks, {len(cached_gradients)} cached gradients and "
                f"{len(random_states)} random states: they must pair up"
            )
        if no_sync_except_last:
            _check_ddp([model])
        last = len(model_inputs) - 1
        for i, (chunk, grad, state) in enumerate(zip(model_inputs, cached_gradients, random_states)):
            with model.no_sync() if no_sync_except_last and i < last else nullcontext():
                with state:
                    reps = self.get_reps(self.model_call(model, chunk))
                if reps.shape != grad.shape:
                    raise ValueError(
                        f"chunk {i}: the recomputed representation has shape {list(reps.shape)}, "
                        f"the cached gradient {list(grad.shape)}"
                    )
                # At least float32 (float64 stays float64), and outside any autocast the caller opened.
                dtype = torch.promote_types(torch.promote_types(reps.dtype, grad.dtype), torch.float32)
                with torch.autocast(reps.device.type, enabled=False):
                    surrogate = torch.dot(reps.flatten().to(dtype), grad.flatten().to(dtype))
                surrogate.backward()

    # --- the step -------------------------------------------------------------------------------

    def cache_step(self, *model_inputs: Any, no_sync_except_last: bool = False, **loss_kwargs: Any) -> Tensor:
        """Steps 1-3 over one batch per model: the gradients of loss_fn(*reps, **loss_kwargs) with
        respect to every model's parameters are accumulated into `.grad`. Returns the loss (detached)."""
        if len(model_inputs) != len(self.models):
            raise ValueError(f"cache_step got {len(model_inputs)} inputs for {len(self.models)} models")
        if no_sync_except_last:
            _check_ddp(self.models)
        # Every input is cut (and checked) before the first forward, hence before any collective.
        chunked = [self.split_inputs(x, c) for x, c in zip(model_inputs, self.chunk_sizes)]
        for i, chunks in enumerate(chunked):
            if not chunks:
                raise ValueError(f"the input of model {i} split into no chunks")

        all_reps, all_states = zip(*(self._forward_chunks(m, c) for m, c in zip(self.models, chunked)))
        cache, loss = self.build_cache(*(torch.cat(r) for r in all_reps), **loss_kwargs)

        last_use = {id(m): i for i, m in enumerate(self.models)}
        for i, (model, chunks, reps, states) in enumerate(zip(self.models, chunked, all_reps, all_states)):
            grads = cache[i].split([r.shape[0] for r in reps])  # the rows each chunk really produced
            # A model used again later waits for its last use to synchronise.
            defer = no_sync_except_last and last_use[id(model)] != i
            with model.no_sync() if defer else nullcontext():
                self.forward_backward(model, chunks, grads, states, no_sync_except_last=no_sync_except_last)
        return loss


def _check_ddp(models: Sequence[nn.Module]) -> None:
    plain = [i for i, m in enumerate(models) if not isinstance(m, DistributedDataParallel)]
    if plain:
        raise ValueError(
            f"no_sync_except_last=True needs every model wrapped in DistributedDataParallel; model(s) {plain} are not"
        )
