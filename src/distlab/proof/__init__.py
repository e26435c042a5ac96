"""The proof machinery: what an equivalence check trains, its independent reference, its comparison, its
measurements, the verdict a lesson ends with, and the lessons' command line that sets them.

The top of the ground floor: it stands on `distlab.processes`, `distlab.pieces` and `distlab.comm`, and none of
them imports it.

- `models`: the toy models and data every lesson uses (layered MLP, the transformer block, two towers), built
  identically on every rank from a seed; `sizes`: a transformer by its sizes alone (`Transformer`, the one
  size record lessons 08, 12 and 13, the cost model and the planner share); `training`: the one training
  loop and its record (`Run`);
  `reference`: the one-process reference (a deep copy, the whole batch, plain autograd);
- `compare`: reference vs distributed, tensor by tensor, with the tolerances per dtype; `verdict`: a lesson's
  claims by name, agreed on by every rank, the exit code, `--json`; `cli`: the lessons' parser (their shared
  flags, each numeric flag's limit, the dtypes `compare` has tolerances for): lessons only, no library module
  imports it;
- measurement: `held` (what a step holds, counted by storage: the one rule), `memory` (`PeakMemory`, a
  block's peak tensor bytes on any device), `timeline` (who computes when), `emulate` (a device that costs a
  fixed wall time without a core), `hardware` (the datasheets' devices and links with their sources, what
  lesson 11's crossover and the cost model price on), `launch_count` (`LaunchCount`: the kernel launches and
  bytes of a block of code, torch ops and Triton kernels alike, on the meta device too).

What may not live here: a way of splitting training (each is its own package) or a cost formula of one (its
package states it; `distlab.cost` reads them all). Nothing here imports a sibling package.
"""
