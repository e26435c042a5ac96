"""Collectives and data parallelism (lesson 06), one job per module:

- `measure`: every collective run, checked, counted and timed in one pass: torch's, the lesson's rings by
  hand and the ground floor's twin of them (what each computes, its ring formula, `Ring` and the timing
  are the ground floor's: `distlab.comm`);
- `problem`: the model, the global batch and each rank's share, the two losses (a mean over
  samples, and a log-sum-exp over the whole batch), the gather with the local block's graph;
- `training`: data-parallel SGD on the one training loop (`distlab.proof.training`), whatever syncs the gradients;
- `overlap`: step time of the sync strategies, and one step's bucket timeline;
- `ddp`: DistributedDataParallel measured: averaging, `no_sync`, `find_unused_parameters`, a global loss;
- `report`: the tables, laid out for 80 columns.

The lesson's own mechanisms (the rings by hand, the all-reduce loop, the gradient buckets) live in the lesson.
"""
