"""The processes a run stands on: torchrun's environment, the process group, devices, and the command line.

- `runtime`: the process group from torchrun's env (`Runtime`: who am I), backend and device, timeouts, the
  release of every DDP before the group; `spawn`: torchrun's job inside one process (tests, notebooks);
  `nodes`: a survivor's line naming the ranks that died (their pids, enrolled in the store), said before the
  teardown, and several torchrun agents (which ranks a node ran);
- `strict`: strict device mode (a collective on a tensor not on `rt.device` raises, on a CPU too);
  `reproducible`: float32 that stays float32 on a GPU, deterministic runs; `compat`: the collectives whose
  names changed between torch 2.11 and 2.13;
- `agree`: agree across ranks, then raise: every rank the same error, or none;
- `scratch`: a temporary directory a killed run does not leave behind; `committed`: a distributed checkpoint
  with one writer (a lock), staged, then committed by a marker of sizes and SHA-256s written last, and checked
  against it before a load; a full disk or a commit killed between its renames refused in one line;
- `lives`: child processes a lesson lets die (SIGKILL) and starts again, each reaped on every way out;
  `lighthouse`: torchft's Lighthouse, stores and Managers on the loopback, and its status page read (lesson 20);
- `flags`: argument types, the rules that need the world size (`require`, the one "P divides N"), `FlagParser`
  with a program's own limits; `cli`: the lessons' parser and their limits, for lessons only.

What may not live here: anything that computes or judges a model's numbers (that is `distlab.proof`), and
anything of one way of splitting. Nothing here imports a sibling package, and no library module imports `cli`.
"""
