"""Overlap and resilience (lessons 18-20): what lets a run lose a member and go on.

- `lives`: child processes a lesson lets die (SIGKILL) and starts again, each reaped on every way out;
- `lighthouse`: torchft on the loopback: the Lighthouse on rank 0, a store per island, a rank's `Manager`, and
  the Lighthouse's status page read to wait for a state of the quorum.

They serve lesson 20 (DiLoCo islands; its DiLoCo itself is written out in the lesson). Lessons 18 and 19 overlap
work inside the parts they extend (`layer_split.tensor_parallel`'s layers, `model_split`'s runner) and need no
room of their own. It imports the ground floor only.
"""
