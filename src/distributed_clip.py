"""The public import path of seed 000: `from distributed_clip import distributed_train_step`.

One exact, memory-streamed optimiser step of symmetric contrastive (CLIP) training under DDP; see
`distlab.contrastive.streamed` for the five phases and the math, and lesson 11 for a training loop.

    loss = distributed_train_step(model, optimizer, local_x, local_y, {
        "GLOBAL_BATCH_SIZE": N, "MICRO_BATCH_SIZE": B, "STREAM_CHUNK_SIZE": M, "TAU": tau,
        # optional: "PHASE_B": "sharded" (default) or "replicated"
    })
"""

from distlab.contrastive.streamed import distributed_train_step

__all__ = ["distributed_train_step"]
