"""The public import path of the streamed contrastive step: exact, memory-streamed CLIP training.

    from distributed_clip import ClipLoss, SigLipLoss, distributed_backward, distributed_train_step
    from distributed_clip import release_process_group

    loss = distributed_train_step(model, optimizer, local_x, local_y, config)   # zero_grad, backward, step
    loss = distributed_backward(model, local_x, local_y, config, grad_scaler=scaler)  # you own the rest
    loss = ClipLoss(rank=rank, world_size=world_size)(image_features, text_features, logit_scale)  # a loss module
    release_process_group()                                      # the last line: a clean exit

config = {"GLOBAL_BATCH_SIZE": N, "MICRO_BATCH_SIZE": B, "STREAM_CHUNK_SIZE": T, "TAU": tau}; leave TAU
out when model(x, y) returns (z_x, z_y, logit_scale). Optional "NORMALISERS": "sharded" (default) or
"replicated"; optional "EXCHANGE": "gather" (default) or "ring" (C x d blocks pass rank to rank,
lesson 26). A model returning (z_x, z_y, logit_scale, logit_bias), or open_clip's output dict with a
logit_bias, selects the sigmoid loss (SigLIP) instead of the symmetric InfoNCE. The model is DDP,
torch.compile(DDP) or FSDP2-wrapped; forward(x, y) returns a tuple or open_clip's dict (output_dict=True),
so a stock open_clip CLIP drops in. local_x and local_y may be tensors, or dicts, lists or tuples of tensors
(a tokenizer's input_ids and attention_mask). `ClipLoss` and `SigLipLoss` are the same exact global loss
as open_clip-style loss modules (`distlab.streamed.loss_modules`), for a trainer that owns its forward.
See `distlab.streamed.step` for the phases and the math, lesson 25 for a training loop, and docs/distributed_clip.md,
"Using distributed_clip in your training".
"""

from distlab.processes.runtime import release_process_group
from distlab.streamed import distributed_backward, distributed_train_step
from distlab.streamed.loss_modules import ClipLoss, SigLipLoss

__all__ = ["ClipLoss", "SigLipLoss", "distributed_backward", "distributed_train_step", "release_process_group"]
