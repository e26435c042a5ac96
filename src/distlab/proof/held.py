"""What a training step holds on a rank, item by item, counted by storage: the model states (weights,
gradients, the optimizer's states) and the activations autograd saves for backward.

One counting rule for every lesson that reports bytes held (02-03, 07-08): a tensor's bytes are those of
its STORAGE, and each storage is counted once however many tensors are views of it and however many
times autograd saves it. A Tanh output that the next Linear saves again is one storage, counted once;
q, k and v cut from one fused projection are one storage, counted once, whole; and a view of a larger
tensor (a micro-batch's rows of the batch, say) counts the whole storage it keeps alive, since that is
what memory holds. Storages that exist anyway (parameters, a batch made before the step) are excluded
by the caller, who names them.

- `storage_bytes(tensors)`: the bytes of the distinct storages under a list of tensors;
- `model_states(weights, gradients, states)`: the "what a step holds" items, the same names everywhere;
- `SavedActivations`: a `saved_tensors_hooks` counter of what autograd saves inside a block.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.autograd.graph import saved_tensors_hooks


def storage_key(t: torch.Tensor) -> int:
    """Which storage `t` is a view of (its first byte's address: one per live storage)."""
    return t.untyped_storage().data_ptr()


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages under `tensors` (views of one storage count once, whole)."""
    return sum({storage_key(t): t.untyped_storage().nbytes() for t in tensors}.values())


def model_states(
    weights: list[torch.Tensor], gradients: list[torch.Tensor | None], states: list[dict]
) -> dict[str, list[torch.Tensor]]:
    """The tensors of each item a rank holds after a step, by item: the weights, their gradients (None:
    none held), and AdamW's state of each tensor it steps: the two moments m, v and the step count."""
    return {
        "weights": list(weights),
        "gradients": [g for g in gradients if g is not None],
        "moments": [state[k] for state in states for k in ("exp_avg", "exp_avg_sq") if k in state],
        "step counts": [state["step"] for state in states if "step" in state],
    }


class SavedActivations:
    """with SavedActivations(exclude=model.parameters()) as saved: loss = forward()
    then saved.nbytes: the bytes autograd saved for backward inside the block, by storage (see above).

    `saved_tensors_hooks` hands each tensor autograd saves to a "pack" hook as it is saved; the counter
    notes its storage and hands the tensor back unchanged (it only watches). `storages` maps each
    storage counted to its bytes, so that a caller holding several blocks' counts (a pipeline stage,
    several micro-batches in flight) can tell what they share."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()):
        self.excluded = {storage_key(t) for t in exclude}
        self.storages: dict[int, int] = {}

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        key = storage_key(t)
        if key not in self.excluded:
            self.storages[key] = t.untyped_storage().nbytes()
        return t

    def __enter__(self) -> SavedActivations:
        self._hooks = saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    @property
    def nbytes(self) -> int:
        return sum(self.storages.values())
