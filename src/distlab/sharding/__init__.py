"""Sharding a training step (lesson 07), one job per module:

- `accounting`: what a step holds, item by item, in bytes per rank (weights, gradients, AdamW's
  moments, the master copy, activations) for DDP and ZeRO-1/2/3, and the bytes each rank sends;
- `flat`: a layer's parameters as one flat buffer padded to P equal shards (Psi not divisible by P);
- `problem`: the model, each step's global batch, the loss, AdamW, the one-process reference;
- `block`: a small transformer block for the memory accounting;
- `holds`: one step of plain data parallelism measured item by item (float64 and mixed precision);
- `ddp`, `zero`, `fsdp`: the strategies (DDP's ring all-reduce; ZeRO-1, -2, -3; FSDP2's fully_shard);
- `training`: the loop they all run, measuring memory and counting bytes;
- `checkpoint`: save sharded with torch.distributed.checkpoint, resume at another P;
- `report`: the tables, laid out for 80 columns.

The lesson writes ZeRO-1, -2 and -3 out itself; `zero` holds the same mechanisms as classes.
"""
