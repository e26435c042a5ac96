"""The proof machinery: what an equivalence check trains, its independent reference, its comparison, its
measurements, and the verdict a lesson ends with.

- `models`: the toy models and data every lesson uses (layered MLP, the transformer block, two towers), built
  identically on every rank from a seed; `sizes`: a transformer by its sizes alone (`Transformer`, the one
  size record lessons 08, 12 and 13, the cost model and the planner share); `training`: the one training
  loop and its record (`Run`);
  `reference`: the one-process reference (a deep copy, the whole batch, plain autograd);
- `compare`: reference vs distributed, tensor by tensor, with the tolerances per dtype; `verdict`: a lesson's
  claims by name, agreed on by every rank, the exit code, `--json`; `console`: output that reads the same in
  a terminal, a pipe and a notebook;
- measurement: `held` (what a step holds, counted by storage: the one rule), `memory` (`PeakMemory`, a
  block's peak tensor bytes on any device), `timeline` (who computes when), `emulate` (a device that costs a
  fixed wall time without a core).

What may not live here: a way of splitting training (each is its own package) or a cost formula of one (its
package states it; `distlab.cost` reads them all). Nothing here imports a sibling package.
"""
