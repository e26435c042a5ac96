"""Expert parallelism (lesson 10): a mixture-of-experts layer whose E experts are split over the ranks.

- `moe`: the model in one process, the reference: router (softmax gate, top-kappa), E expert MLPs, the
  capacity rule and its drops, the load-balancing loss, and the transformer block it sits in;
- `cost`: what a rank sends (dispatch and combine, forward and backward, the counts), by formula from the
  routing, and the routing matrix between ranks;
- `training`: data whose ranks hold different domains, and the measures of expert load the lesson's short
  training run reports.

The expert-parallel layer itself (the counts exchanged, the tokens dispatched by an all-to-all with uneven
splits, the experts, the combine by the reverse all-to-all) is written out in
`lessons/10_expert_parallel.py`, on the ground floor's all-to-all (`distlab.comm`).
"""
