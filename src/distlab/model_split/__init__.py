"""The model split (lessons 01-05, and DualPipe's schedules of lesson 19): pipeline parallelism, its stages,
point-to-point transfers, schedules and their runner.

- `partition`: an `nn.Sequential` cut into contiguous stages, the shapes at the cuts; `p2p`: which activation
  or gradient goes to which rank, batched;
- `schedules`: GPipe, 1F1B, interleaved, ZB-H1, ZB-V as data (who runs which F, I, W when); `simulator`: the
  unit-time grid, the bubble and the in-flight count read off it; `runner`: one rank executes its actions;
- `torch_engine`: the same split model under `torch.distributed.pipelining`; `probe`: what a stage holds and
  computes, measured; `training`: the track's configuration, its loop and its unsplit reference; `report`;
- `two_chains`: DualPipe's two copies fed from both ends, on a runner of two chains (lesson 19).

What may not live here: another way of splitting (a sibling package) or anything shared by several (the ground
floor). It imports the ground floor only.
"""
