"""What a training step costs: FLOPs, bytes held, bytes sent, and time, per rank, predicted from sizes.

Every formula here is one a lesson proves on real ranks, imported from that lesson's library module and
composed, never derived again (tests/test_cost_*.py hold the composition to the lessons' measurements):

| module     | what                                              | proved by                                     |
|------------|---------------------------------------------------|-----------------------------------------------|
| `dims`     | a run's shape (dp, pp, tp, cp, ep): checked, laid out, its sub-meshes named | lesson 12's mesh |
| `inputs`   | what it is asked: a model by its sizes, the batch, the precision, the strategy | -      |
| `rules`    | what cannot run refused in one line naming the field (`check`) | -   |
| `flops`    | forward, backward, recomputation; the model's FLOPs | lesson 13 (torch's FlopCounterMode)         |
| `memory`   | weights, gradients, optimizer states, activations | lesson 07 (ZeRO), 08 (TP/SP), 02-05 (in flight) |
| `traffic`  | bytes per collective per mesh dimension           | 07 (dp), 08 (tp), 09 (cp), 10 (ep), 01-03 (pp) |
| `schedule` | the pipeline's placement, in-flight counts, grid  | 02-05 (`distlab.model_split.simulator`)          |
| `step`     | all of it for each pipeline position: `step_cost` | -                                             |
| `timing`   | compute, memory, communication, overlap, bubble; step time, MFU | lesson 13 (time within a factor) |
| `stacks`   | efficiency profiles of software stacks, fitted on published runs | the published runs (planner) |
| `trial`    | the measured side: a split built, run, counted and timed on this rank | lesson 13 (what it compares) |

This package stands on every parallelism's package (the top floor, tests/test_layering.py, beside `plan` and
`composed`, which share its `dims.ParallelDims`): nothing below imports it. `python -m distlab.plan` ranks
the configurations that fit a cluster with it.
"""
