"""The ground floor of communication: what every parallelism in distlab sends, written once.

- `collectives`: what all_reduce, all_gather, reduce_scatter, broadcast and all_to_all compute
  (against one process), and the bytes a ring sends for each, as exact fractions of the full tensor;
- `p2p`: the one point-to-point exchange, `post` every send and receive at once, `wait` later
  (`Posted`), over any group, at any P (one rank included);
- `ring`: the collectives by hand on that exchange (`Ring`: a shift, reduce-scatter, all-gather,
  all-reduce, broadcast, all-to-all with uneven parts), counting what they send;
- `differentiable`: the all-to-all with its backward (the reverse all-to-all), for expert parallelism
  and Ulysses (lessons 10, 11);
- `ledger`: what a rank sent, counted in exact integers (`Ledger.sent`), by phase and kind;
- `timing`: how long a collective takes, on the slowest rank;
- `compat`: the collectives whose names changed between torch 2.11 and 2.13, in one place;
- `agree`: agree across ranks, then raise: one exchanged table, every rank the same error, or none;
- `watch`: torch's own collectives (DTensor's, FSDP2's, the pipeline schedules' sends), counted by the
  group they ran on into one ledger per group, priced as the ledger prices ours.

It stands on `distlab.processes` alone. Every parallelism package (model_split, data_parallel, sharding,
tensor_parallel, context_parallel, expert_parallel, resilience, contrastive, streamed) stands on these and never
on a sibling.
"""
