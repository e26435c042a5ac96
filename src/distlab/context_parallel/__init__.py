"""Context parallelism (lesson 09): the sequence split over the ranks, attention by a ring.

- `split`: which positions each rank holds (contiguous or zig-zag), the tiles that causal attention
  computes, fully or masked, and the work per rank they add up to;
- `attention`: attention one key/value tile at a time, forward (the online max/sum fold of
  `distlab.online_softmax`) and backward (probabilities recomputed from the saved log-sum-exp);
- `ring`: the exchange, posted ahead of the block math, counting the bytes it sends.

The ring loops themselves are written out in `lessons/09_context_parallel.py`.
"""
