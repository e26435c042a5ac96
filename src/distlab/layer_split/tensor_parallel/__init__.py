"""Tensor, sequence and 2-D parallelism of a transformer block (lesson 08), one job per module:

- `model`: the unsplit block (`distlab.proof.models.Block`: causal, q, k, v apart), the batch, dropout masks
  drawn outside;
- `operators`: f, g (tensor parallel) and f-bar, g-bar (sequence parallel) as autograd Functions, each
  counting the bytes it sends (a `distlab.comm.ledger.Ledger`); `Comm` pairs the two a block is built with;
- `layers`: column- and row-parallel Linear, cut from an unsplit nn.Linear; the reference cut the same way;
- `blocks`: the MLP (column then row) and attention by heads split over P ranks, the whole block;
- `sequence`: what sequence parallelism adds (sequence parts, the partial gradients' all-reduce);
- `runs`: a split run and the unsplit reference, both on the one training loop (`distlab.proof.training`), compared;
- `cost`: bytes and activation memory in closed form; `operator_checks`: each operator against one process;
- `torch_tp`: the same block under torch's `parallelize_module`; `mesh2d`: data x tensor parallel on a mesh;
- `report`: the tables, laid out for 80 columns.

The lesson's own f and g live in the lesson.
"""
