"""The streamed contrastive step (lessons 25-26): the exact InfoNCE or sigmoid gradient of a global batch of N
pairs, with O(C d) activations per rank and tiles of at most T x T, never N x N.

Start at `step`, the front door: its docstring has the math and the five phases in the order they run, its `_run`
reads them top to bottom, and it names every module below for the one job the step hands it. One job a file:

the step
  `step`            the front door: `distributed_train_step`, `distributed_backward`, the five phases
  `config`          the config dict read into the names the math uses (N, B, T, TAU, NORMALISERS, EXCHANGE, ...)
  `wrappers`        DDP, torch.compile(DDP), FSDP2, BatchNorm, the device and the compute dtype
  `safeguards`      the guards, one entry per phase: the call agreed across ranks, a non-finite loss or gradient
                    stopped, a dead peer named, the exit hint on every error, a loss module's call agreed
how the ranks' embeddings meet
  `exchange`        the gather or the ring (EXCHANGE), the gathered sigmoid's shares, the bytes each rank sends
  `ring_passes`     the ring: C x d blocks pass rank to rank, the InfoNCE's and the sigmoid's passes
the losses' tile work
  `torch_tiles`     the InfoNCE's tiles in torch ops, S in memory: log-sum-exps by the online fold, G by tiles
  `own_block`       the torch tiles' phases 2 and 3 with a rank's own block of S made once for rows and columns
  `sigmoid`         the sigmoid loss (SigLIP): its closed-form gradient, in torch tiles
  `kernels`         the same tile work as Triton kernels, S in registers (`kernels.register_tile`)
  `kernel_choice`   KERNELS: the torch tiles or the kernels, behind one interface (`TileOps`)
  `precision`       MATMUL_PRECISION, pinned around the tiles
  `chunk_size`      the default T (the stream chunk), and the warning when a T launches too many kernels
counting the tile work
  `rank_work`       one rank's tile work without the exchange, to count (`distlab.proof.launch_count`) or time
                    a large step on one device
the loss as a module
  `loss_modules`    `ClipLoss`, `SigLipLoss`: the step's exact global loss where a trainer plugs a loss

Imports point one way, with no circle: the tile modules (`torch_tiles`, `sigmoid`, `kernels`) under
`kernel_choice`, under `exchange` and `ring_passes`, under `step`, under `loss_modules` and `rank_work`; `safeguards`
reads only `config`, `wrappers` and `kernel_choice`'s check of KERNELS, and the step and the loss modules read
it. Every contrastive loss of the repository, these and `distlab.contrastive`'s, is listed with where it lives
and what it is for in docs/losses.md. The public import path is `distributed_clip`.
"""

from distlab.streamed.step import distributed_backward, distributed_train_step, loss_machinery

__all__ = ["distributed_backward", "distributed_train_step", "loss_machinery"]
