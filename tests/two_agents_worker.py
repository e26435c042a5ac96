"""One rank of tests/test_two_agents.py: the streamed step (or, with TWO_AGENTS_WORK=plain, DDP's own backward) in
a loop under torchrun, in `distributed()` and
`run_main` as a lesson runs (so what it prints is what a lesson's rank prints). After its first step it writes
its pid to $TWO_AGENTS_DIR/pid<RANK>, for the test to kill it."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from streamed_helpers import Towers
from torch.nn.parallel import DistributedDataParallel as DDP

from distlab.processes.runtime import distributed, run_main
from distributed_clip import distributed_backward

C = 6  # pairs per rank


def main() -> int:
    torch.set_num_threads(1)
    with distributed("cpu", timeout_s=float(os.environ["TWO_AGENTS_TIMEOUT_S"])) as rt:
        model, gen = DDP(Towers(scale_shape=())), torch.Generator().manual_seed(rt.rank)
        x, y = (
            torch.randn(C, 12, generator=gen, dtype=torch.float64),
            torch.randn(C, 10, generator=gen, dtype=torch.float64),
        )
        config = {"GLOBAL_BATCH_SIZE": C * rt.world_size, "MICRO_BATCH_SIZE": C}
        plain = os.environ.get("TWO_AGENTS_WORK") == "plain"  # a lesson's loop: DDP's all-reduce, no heartbeat
        for step in range(100_000):
            if plain:
                sum(out.sum() for out in model(x, y)).backward()
            else:
                distributed_backward(model, x, y, config)
            if step == 0:
                Path(os.environ["TWO_AGENTS_DIR"], f"pid{rt.rank}").write_text(str(os.getpid()))
    return 0


if __name__ == "__main__":
    run_main(main)
