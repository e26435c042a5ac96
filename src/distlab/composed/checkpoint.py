"""A checkpoint of the whole mesh with `torch.distributed.checkpoint` (DCP), loaded at any other shape.

Lesson 07 saved FSDP2's shards at P and loaded them at P / 2. On the mesh every rank holds a different
piece: only its pipeline stage's parameters, and of those its tp rank's piece, and of that its dp x cp shard.
Three things make that piece loadable anywhere else:

- names: `get_state_dict(model, optimizer)` keys the model's and AdamW's states by the parameter's name, and a
  stage keeps the whole model's names (`composed.model.keep_stage`), so "layers.3.mlp.fc1.weight" names the
  same tensor at pp = 1, 2 or 4. AdamW's state must be flattened too (`flatten_optimizer_state_dict`): left
  nested, its param_groups are a list whose entry 0 lists one stage's names, a value DCP saves once for
  every rank (it looks replicated), so a rank of another stage loads a group naming none of its parameters
  and its hyper-parameters are lost (torch's own note: flattening is what pipeline parallelism needs);
- placements: every value is a DTensor that knows its mesh and placements, so DCP writes each rank's local
  shard with its offsets in the whole tensor, and rank 0 adds one metadata file listing every piece;
- resharding on load: a fresh model at the new shape asks, rank by rank, for the pieces its own shards cover
  (`dcp.load` reads them from whichever files hold them), and `set_state_dict` puts them in place.

Every rank calls save and load together (over the world's group): a rank with no piece of a tensor simply
asks for none. The folder is staged and committed (`distlab.processes.committed`): a save killed half-way leaves the
last whole checkpoint or none, never shards of two saves, and a load refuses a torn, truncated or damaged
folder in one line naming the file, on every rank, before DCP reads it.

Step k's batch is a function of (seed, k), so a resumed run sees the batches an uninterrupted one sees. At
the same shape every sum runs in the same order again: bit-identical. At another, the dp x cp averages and
the tp sums are grouped differently: equal to float64 rounding.
"""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from distlab.processes.committed import load_committed, save_committed

FLAT = StateDictOptions(flatten_optimizer_state_dict=True)  # every optimizer entry keyed by its parameter's name


def save(path: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Every rank writes its shards of the model and of AdamW's states; `path` holds them once all are whole."""
    model_state, optim_state = get_state_dict(model, optimizer, options=FLAT)
    save_committed(path, lambda staging: dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=staging))


def load(path: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Into a model and optimizer laid out on any mesh: each rank reads the pieces its shards cover."""
    model_state, optim_state = get_state_dict(model, optimizer, options=FLAT)
    state = {"model": model_state, "optim": optim_state}
    load_committed(path, lambda folder: dcp.load(state, checkpoint_id=folder))  # checked against its marker first
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=FLAT)
