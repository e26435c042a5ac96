"""Replaying randomness: the same dropout masks in a no-grad pass and in its recomputation.

GradCache (lesson 13) and the streamed step (lesson 14) run every chunk twice: once without grad to
get representations, once with grad to back-propagate. If dropout draws different masks the second
time, the gradient belongs to a different function than the loss that was computed. `RandContext`
snapshots the random state before the first pass and replays it for the second:

    state = RandContext(chunk)          # before the no-grad forward
    ...
    with state:                         # the recompute sees the same masks
        out = model(chunk)

It saves the CPU generator and the generator of every CUDA device that any tensor in the inputs
lives on (dicts, lists and tuples are searched). The functional API of luyug/GradCache
(`grad_cache.functional.cached`, https://github.com/luyug/GradCache) creates its context without the
inputs, so on GPUs it saves no CUDA state and the two passes draw different masks; here the inputs
are always passed. `with state:` forks the generators, so the random stream outside continues as if the
replay never happened.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import get_device_states, set_device_states


class RandContext:
    def __init__(self, *inputs: Any) -> None:
        tensors = [t for t in tree_leaves(inputs) if isinstance(t, torch.Tensor)]
        self.cpu_state = torch.get_rng_state()
        self.devices, self.device_states = get_device_states(*tensors)
        self._fork = None

    def __enter__(self) -> RandContext:
        self._fork = torch.random.fork_rng(devices=self.devices, enabled=True)
        self._fork.__enter__()
        torch.set_rng_state(self.cpu_state)
        set_device_states(self.devices, self.device_states)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._fork.__exit__(*exc)
        self._fork = None
