"""Replaying randomness: the same dropout masks in a no-grad pass and in its recomputation.

GradCache (lesson 24) and the streamed step (lesson 25) run every chunk twice: once without grad to
get representations, once with grad to back-propagate. If dropout draws different masks the second
time, the gradient belongs to a different function than the loss that was computed. `RandContext`
snapshots the random state before the first pass and replays it for the second:

    state = RandContext(model, chunk)   # before the no-grad forward
    ...
    with state:                         # the recompute sees the same masks
        out = model(chunk)

It saves the CPU generator and the generator of every CUDA device that any tensor in the inputs
lives on (dicts, lists and tuples are searched), and of every device the parameters and buffers of a
module passed among the inputs live on: a model on the GPU that is handed CPU batches and moves them
inside its forward draws its masks from the GPU's generator, which the batch alone would not name.
The functional API of luyug/GradCache (`grad_cache.functional.cached`, https://github.com/luyug/GradCache)
creates its context without the inputs, so on GPUs it saves no CUDA state and the two passes draw
different masks; here the inputs are always passed, and the library's callers pass the model too.
`with state:` forks the generators, so the random stream outside continues as if the replay never happened.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves


class RandContext:
    def __init__(self, *inputs: Any) -> None:
        """`inputs`: the chunk (tensors, nested in dicts, lists, tuples) and the model that will run it."""
        self.cpu_state = torch.get_rng_state()
        self.devices = self.cuda_devices(*inputs)
        self.device_states = [torch.cuda.get_rng_state(index) for index in self.devices]
        self._fork = None

    @staticmethod
    def cuda_devices(*inputs: Any) -> list[int]:
        """The CUDA devices (indices, each once) of the tensors in `inputs` and of the modules' parameters
        and buffers: every generator the forward may draw from."""
        tensors = []
        for leaf in tree_leaves(inputs):
            if isinstance(leaf, nn.Module):
                tensors += [*leaf.parameters(), *leaf.buffers()]
            elif isinstance(leaf, torch.Tensor):
                tensors.append(leaf)
        devices = {t.device for t in tensors if t.device.type == "cuda"}  # (a DTensor's too: FSDP2's parameters)
        return sorted({torch.cuda.current_device() if d.index is None else d.index for d in devices})

    def __enter__(self) -> RandContext:
        self._fork = torch.random.fork_rng(devices=self.devices, enabled=True)
        self._fork.__enter__()
        torch.set_rng_state(self.cpu_state)
        for index, state in zip(self.devices, self.device_states):
            torch.cuda.set_rng_state(state, index)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._fork.__exit__(*exc)
        self._fork = None
