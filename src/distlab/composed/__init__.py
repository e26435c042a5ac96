"""One transformer trained on a dp x pp x tp x cp mesh (lesson 12), the parts that are not the composition
itself (that is written out in the lesson, from torch's DeviceMesh, fully_shard, parallelize_module and
pipelining, and the ring of `distlab.layer_split.context_parallel`):

- `config`: the model's sizes, a mesh's shape (dp x pp x tp x cp), its groups and the rules it must keep;
- `model`: the decoder-only transformer over the ground floor's block, its pipeline stages, its token stream;
- `trainee`: what the one training loop (`distlab.proof.training.train`) reads of a model whose parameters are
  DTensors spread over the mesh, gathered whole by name;
- `cost`: bytes per rank and step by mesh dimension, and memory per rank, in closed form;
- `activations`, `measure`: what a step saves for backward and sends on each dimension, measured;
- `checkpoint`: torch.distributed.checkpoint of every stage's shards, loaded at any other shape.
"""
