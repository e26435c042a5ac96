"""Exercise 10: the expert-parallel MoE layer, dispatch and combine (read lessons/10_expert_parallel.py first;
check your answer with `pytest --exercises -k 10`; add `--hint-level 1`, 2 or 3 for help).

Every rank holds C seq tokens u (rows of width d), the replicated router, and E / P of the E experts: rank r
owns experts r E/P .. (r+1) E/P - 1. Write `expert_parallel_moe(layer, u)`: return (MoE(u), L_aux) for this
rank's tokens, equal to one process running the whole MoE on all N seq tokens of the step, where

    gate_t = softmax(u_t W_router^T);  token t goes to its kappa best experts, weights = their gates
             (renormalised over the kappa when kappa = 2): `distlab.layer_split.expert_parallel.moe.route` does this;
    MoE(u_t) = sum over the kept choices (t, i) of weight_t,i Expert_i(u_t);
    capacity = ceil(gamma kappa N seq / E) tokens per expert and step (`moe.capacity(cfg, N seq)`), kept in
             global order: for each expert, rank 0's tokens (in token order) first, then rank 1's, ...;
             the first `capacity` are kept, the rest dropped (they add nothing);
    L_aux    = E sum_i phi_i pi_i: phi_i the fraction of the step's kappa N seq choices (before drops) that
             went to expert i, pi_i the mean gate of expert i over this rank's tokens (the judge averages
             the ranks' L_aux and gradients, as DDP does; `moe.balance_loss(phi, pi)`).

So: count, per expert, the choices of this rank's tokens; exchange the counts (every rank needs every rank's
to apply the capacity rule and to know how many rows will arrive from where); send each kept token's row to
the rank owning its expert with one all-to-all of uneven splits (rows for rank q's experts, in expert order,
go to rank q); run your experts on what arrives (each expert on its rows of every source rank, in rank
order); send the outputs back with the reverse all-to-all; add each into its token's row with its weight.
The gradients must flow back through both all-to-alls: an all-to-all's backward is the reverse all-to-all.

What you are given: `layer.cfg` (a `MoEConfig`: `experts` E, `top_k` kappa, `capacity_factor` gamma, or None
for no capacity), `layer.router` (nn.Linear d -> E, no bias), `layer.experts` (an nn.ModuleDict: the key is
an expert's global index as a string, "3", and the value its MLP; this rank's E / P experts), `layer.group`
(the process group, None: the world). torch.distributed is initialised; `distlab.comm.differentiable` and
`distlab.comm.compat` hold collectives you may use. Every rank holds the same number of tokens.

The judge (P = 3, E = 6, kappa = 2, gamma = 1, drops happen) checks the block's output, L_aux, the experts'
and the replicated weights' gradients against one process on the whole batch (float64, rtol 1e-10), and
the bytes your all-to-alls send: the kept tokens' rows each way, and little more.
"""

from __future__ import annotations

import torch

from distlab.layer_split.expert_parallel.moe import MoEConfig  # noqa: F401  (layer.cfg is one)


def expert_parallel_moe(layer, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Route, exchange the counts, dispatch, run my experts, combine: (MoE(u), L_aux) for this rank's tokens."""
    raise NotImplementedError("not written yet: expert_parallel_moe(layer, u)")
