"""The processes a run stands on: torchrun's environment, the process group, devices, flags, what a rank prints.

The bottom of the ground floor: it imports no other room of distlab (`distlab.pieces`, `distlab.comm` and
`distlab.proof` stand on it).

- `identity`: `Runtime`, who a process is (rank, world size, local rank) and where its tensors live;
  `runtime`: the process group from torchrun's env, backend and device, timeouts, the release of every DDP
  before the group; `spawn`: torchrun's job inside one process (tests, notebooks); `nodes`: a survivor's line
  naming the ranks that died (their pids, enrolled in the store), said before the teardown, and several
  torchrun agents (which ranks a node ran);
- `strict`: strict device mode (a collective on a tensor not on `rt.device` raises, on a CPU too);
  `reproducible`: float32 that stays float32 on a GPU, deterministic runs;
- `scratch`: a temporary directory a killed run does not leave behind; `committed`: a distributed checkpoint
  with one writer (a lock), staged, then committed by a marker of sizes and SHA-256s written last, and checked
  against it before a load; a full disk or a commit killed between its renames refused in one line;
- `flags`: argument types, the rules that need the world size (`require`, the one "P divides N"), `FlagParser`
  with a program's own limits; `console`: output that reads the same in a terminal, a pipe and a notebook
  (rank 0 prints; tables; the one-line error).

What may not live here: anything that computes or judges a model's numbers (that is `distlab.proof`), a
collective (`distlab.comm`), and anything of one way of splitting or of one lesson.
"""
