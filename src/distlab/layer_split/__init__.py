"""The layer split (lessons 08-11): each layer's work is cut across ranks.

- `tensor_parallel` (lesson 08): column- and row-parallel Linear, the conjugate operators, sequence
  parallelism, a dp x tp mesh;
- `context_parallel` (lessons 09, 11): the sequence split, ring attention and Ulysses;
- `expert_parallel` (lesson 10): a mixture of experts, dispatched and combined by all-to-all.

A part of the arc, not a room of its own: it holds its three sibling packages and nothing else. They import the
ground floor only, never each other (tests/test_layering.py).
"""
