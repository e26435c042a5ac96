"""A batch computed in pieces, exactly as the whole: the cuts and folds that let a rank, a tile or a
micro-batch compute its part and the parts add up to the one-process result.

- `chunks`: rows 0 .. n-1 cut into fixed-size chunks or balanced parts (tiles, micro-batches);
- `split_inputs`: a model's input of any structure (tensor, list, tuple, dict) checked and cut along its
  sample axis;
- `online_softmax`: the online max/sum fold and its rescale factor (a log-sum-exp one tile at a time; two
  partial folds merged): ring attention's merge and the streamed step's normalisers;
- `random_state`: `RandContext`, the CPU and device random state replayed (the same dropout masks in a
  no-grad pass and in its recomputation).

What may not live here: communication (`distlab.comm`) or a loss (its package). Pure functions of tensors;
nothing here imports a sibling package.
"""
