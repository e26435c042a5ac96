"""Exercise 07: ZeRO-1 by hand (read lessons/07_sharding.py first; check your answer with
`pytest --exercises -k 07`; add `--hint-level 1`, 2 or 3 for help).

Every rank holds the whole model and has just run backward on the mean loss over its own C = N / P rows.
`Sharded(model, rt, cfg)` (distlab/data_split/sharding/shards.py) has already broadcast rank 0's weights, grouped the
trainable parameters into units (`z.units[u]`, a FlatUnit: `unit.params` are its tensors, each trained
parameter in exactly one unit, the model's own and tied ones in the root's; frozen ones in none), cut each
unit's Psi_u parameters into one flat buffer padded to P ceil(Psi_u / P) elements (`unit.flatten` of a list
of tensors laid out like `unit.params`, `unit.unflatten` of a buffer back into views shaped like them), made
`z.shards[u]`, this rank's shard r of it (an nn.Parameter), and an AdamW `z.optimizer` over the shards only:
the optimizer states are sharded. `z.ring` (distlab/comm/ring.py) runs the ring collectives and counts every
byte they send. The judge's model has a parameter on the root module, an embedding tied to the output layer
and frozen parameters; every trained parameter gets a gradient in every step. The loop the judge drives is

    z.zero_grad(); loss.backward(); z.after_backward(); z.optimizer.step(); z.after_step()

Write the two steps that make it ZeRO-1, and return `z` with them set:

- `z.after_backward`: each shard's .grad must be this rank's part of the mean gradient over ranks,
  dL/dtheta = (1/P) sum_r dL_r/dtheta, without any rank receiving more of it than its own shard;
- `z.after_step`: every rank's whole weights must become the stepped shards of every rank, so the next
  forward runs the updated model everywhere.

The judge checks the gradient each shard is stepped with (step 1), the parameters and AdamW's moments after
3 steps against one process, the weights each rank computes with against the gathered shards, the bytes
the ring sent per step against DDP's 2 (P-1) e Psi_P, and the bytes each rank holds against ZeRO-1's
formula (the whole weights and gradients, a P-th of the moments).
"""

from __future__ import annotations

import torch  # noqa: F401  (you will need it)

from distlab.data_split.sharding.problem import ShardingConfig
from distlab.data_split.sharding.shards import Sharded
from distlab.processes.identity import Runtime


def zero1(model, rt: Runtime, cfg: ShardingConfig) -> Sharded:
    """Optimizer states sharded; every rank keeps the whole weights and the whole gradient."""
    z = Sharded(model, rt, cfg)  # noqa: F841
    raise NotImplementedError("not written yet: zero1(model, rt, cfg)")
