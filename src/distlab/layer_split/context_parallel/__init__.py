"""Context parallelism (lessons 09, 11): the sequence split over the ranks, attention by a ring or by
Ulysses' all-to-alls.

- `split`: which positions each rank holds (contiguous or zig-zag), the tiles that causal attention
  computes, fully or masked, and the work per rank they add up to;
- `attention`: attention one key/value tile at a time, forward (the online max/sum fold of
  `distlab.pieces.online_softmax`) and backward (probabilities recomputed from the saved log-sum-exp);
- `cost`: the bytes each rank sends and the memory it holds, by formula;
- `ring_attention`: the ring loops as a library piece, for a model to call (`ring_core`, an attention core of
  `distlab.proof.models.Attention`), proven equal to the lesson's;
- `ulysses`: lesson 11's rule (P divides h and seq) and its bytes beside ring attention's.

The ring loops are written out in `lessons/09_context_parallel.py`, on the ground floor's exchange
(`distlab.comm.ring.Ring.shift`, posted ahead of the block math, counting what it sends).
"""
