"""distlab: distributed training, built one runnable lesson at a time and proven by tests.

The library is built in floors, and `ls src/distlab` shows them (tests/test_layering.py checks every rule):

- the ground floor, four rooms every package may use, each importing only the ones before it: `processes`
  (torchrun's environment, the process group, devices, flags, what a rank prints), `pieces` (a batch computed
  in pieces exactly as the whole: chunks, input splits, the online softmax fold, replayed randomness), `comm`
  (collectives and their byte formulas, the one point-to-point exchange, the byte ledger, agreeing across
  ranks) and `proof` (the models a check trains, the one training loop, the one-process reference, the
  comparison, the measurements, the verdict, the lessons' command line);
- on it, one package per way to split training, named by the README's parts, which import the ground floor
  and never each other: `model_split` (lessons 01-05, pipelines); the data split, `data_split.data_parallel` (06) and
  `data_split.sharding` (07); the layer split, `layer_split.tensor_parallel` (08),
  `layer_split.context_parallel` (09, 11) and `layer_split.expert_parallel` (10); overlap and resilience,
  `resilience` (20's islands); and the contrastive ones,
  `contrastive` (21-24, 27) and `streamed` (25-26, the step `distributed_clip` imports);
- on top, the packages that read every way at once: `cost` (13: a step's FLOPs, bytes, memory and time from
  each package's formulas), `plan` (the planner on the cost model, `python -m distlab.plan`) and `composed`
  (12: one transformer on a dp x pp x tp x cp mesh, its shape the cost model's `ParallelDims`). Nothing below
  imports them.

Lessons, tests and benchmarks import `distlab`; `distlab` never imports a lesson, a test or the lessons'
command line (`distlab.proof.cli`). docs/layout.md lists every module.
"""

__version__ = "0.1.0"
