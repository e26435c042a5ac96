"""The data split (lessons 06-07): every rank holds the whole model and takes its share of the batch.

- `data_parallel` (lesson 06): collectives measured, data parallelism by hand (buckets all-reduced from hooks
  during backward) and DDP;
- `sharding` (lesson 07): what a step holds per rank, ZeRO-1/2/3, FSDP2 and distributed checkpoints.

A part of the arc, not a room of its own: it holds its two sibling packages and nothing else. They import the
ground floor only, never each other (tests/test_layering.py).
"""
