"""The streamed contrastive step, one job a file: `tiles` (the tile math on one process), `config`
(the config dict), `guards` (a step every rank agreed to, or one error on every rank), `wrappers`
(DDP / compile / FSDP2, BatchNorm, device, precision), `peers` (naming a rank that died mid-step),
`step` (the five phases, `distributed_backward`, `distributed_train_step`)."""

from distlab.streamed.step import distributed_backward, distributed_train_step, loss_machinery

__all__ = ["distributed_backward", "distributed_train_step", "loss_machinery"]
