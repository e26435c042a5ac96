"""Exercise 07: ZeRO-1 by hand (read lessons/07_sharding.py first; check your answer with
`pytest --exercises -k 07`).

Every rank holds the whole model and has just run backward on the mean loss over its own C = N / P rows.
`Sharded(model, rt, cfg)` (distlab/sharding/shards.py) has already cut each layer u's Psi_u parameters into
one flat buffer padded to P ceil(Psi_u / P) elements, made `z.shards[u]`, this rank's shard r of it (an
nn.Parameter), and an AdamW `z.optimizer` over the shards only: the optimizer states are sharded. The
loop is

    z.zero_grad(); loss.backward(); z.after_backward(); z.optimizer.step(); z.after_step()

Write the two steps that make it ZeRO-1:

- `after_backward`: for each layer, flatten its gradients (`unit.flatten([p.grad for p in layer.parameters()])`),
  reduce-scatter them with `z.ring.reduce_scatter(flat)` (rank r receives shard r of the SUM over ranks)
  and put the MEAN, sum / P, into `shard.grad`: dL/dtheta = (1/P) sum_r dL_r/dtheta;
- `after_step`: for each layer, all-gather the stepped shards (`z.ring.all_gather(shard.detach())`) and copy
  them into the layer's parameters (`unit.unflatten(whole)` gives views shaped like them), under no_grad.

Then each rank sends 2 (P-1) e Psi_P bytes per step, as DDP's all-reduce, and holds a P-th of AdamW's moments.

Hints:
- iterate over `zip(z.units, z.layers, z.shards)`;
- use `z.ring` for both collectives: it counts the bytes the check compares with the formula;
- set `z.after_backward, z.after_step = ...` to your two functions and return `z`.
"""

from __future__ import annotations

import torch  # noqa: F401  (you will need it)

from distlab.runtime import Runtime
from distlab.sharding.problem import ShardingConfig
from distlab.sharding.shards import Sharded


def zero1(model, rt: Runtime, cfg: ShardingConfig) -> Sharded:
    """Optimizer states sharded; every rank keeps the whole weights and the whole gradient."""
    z = Sharded(model, rt, cfg)  # noqa: F841
    raise NotImplementedError(
        "not written yet: zero1(model, rt, cfg), a reduce-scatter of every layer's "
        "gradient into its shard (divided by P) after backward, and an all-gather of the "
        "stepped shards into the weights after the step"
    )
