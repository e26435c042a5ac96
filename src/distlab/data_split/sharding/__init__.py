"""Sharding a training step (lesson 07), one job per module:

- `accounting`: what a step holds, item by item, in bytes per rank (weights, gradients, AdamW's
  moments, the master copy, activations) for DDP and ZeRO-1/2/3, and the bytes each rank sends;
- `flat`: a layer's parameters as one flat buffer padded to P equal shards (Psi not divisible by P);
- `problem`: the model, each step's global batch, the loss, AdamW, the one-process reference;
- `holds`: one step of plain data parallelism measured item by item (float64 and mixed precision);
- `replicated`, `shards`, `fsdp`: the strategies' ground (the baseline: whole states on every rank, gradients
  averaged by ring all-reduces, no DDP module; every rank's shards and AdamW on them, from which the lesson's
  ZeRO-1, -2 and -3 start; FSDP2's fully_shard);
- `mixed`: mixed precision for those strategies (bf16 weights and gradients, a float32 master that AdamW
  steps, hung on the optimizer's step hooks) and the same recipe written out for the one-process reference;
- `optimizer`: ZeRO-1 as usually taught, `ShardedOptimizer(params, torch.optim.X, **kwargs)`: any optimizer, each
  parameter stepped whole by the rank that owns it, then broadcast;
- `training`: the one training loop run by every strategy, measuring memory and counting bytes;
- `dcp_resume`: save sharded with torch.distributed.checkpoint, resume at another P (a distributed
  checkpoint; not activation checkpointing, not `distlab.contrastive.checkpointing`'s crash-resume);
- `report`: the tables, laid out for 80 columns.

ZeRO-1, -2 and -3 are written out in the lesson, and only there; the transformer block whose memory it
accounts is `distlab.proof.models.Block`.
"""
