"""Launches and bytes per step of one rank's loss machinery, for the three paths (KERNELS "torch", "triton" and
"triton-mm"),
counted on the meta device: nothing is computed, so the count is the same on any device and a GPU-sized step
counts on a laptop (`distlab.streamed.rank_work.count_rank`, `distlab.proof.launch_count.LaunchCount`).

A launch is a torch op that starts a kernel, or a Triton launch; its bytes are the tensors it reads and writes,
each once (a floor: a tiled product re-reads its operands from the cache). The torch tiles' launches grow with
the tiles a step walks, (C / T)(N / T) per pass; the fused kernels' are the same at every N; "triton-mm" adds
a coefficient kernel and a matmul per chunk of W (`distlab.streamed.kernels.coefficients`).

    python benchmarks/clip_step_launches.py     # N = 4,096 and 65,536, P = 8, d = 1,024, T = 1,024: a Markdown table
"""

from __future__ import annotations

import torch

from distlab.streamed.config import parse_config
from distlab.streamed.rank_work import TAU, count_rank

PATHS = (("torch", "float32", torch.float32), ("triton", "bf16", torch.bfloat16), ("triton-mm", "bf16", torch.bfloat16))


def count_launches(sizes: list[int], world: int, dim: int, chunk: int) -> list[dict]:
    """One row per (N, loss, exchange, path): launches and bytes per step of rank 0."""
    rows = []
    for n in sizes:
        for loss in ("infonce", "sigmoid"):
            for exchange in ("gather", "ring"):
                for kernels, precision, dtype in PATHS:
                    keys = {"GLOBAL_BATCH_SIZE": n, "MICRO_BATCH_SIZE": n // world, "STREAM_CHUNK_SIZE": chunk}
                    keys |= {"TAU": TAU, "EXCHANGE": exchange, "KERNELS": kernels, "MATMUL_PRECISION": precision}
                    count = count_rank(parse_config(keys, world, 0), loss, dim, dtype)
                    row = dict(n=n, loss=loss, exchange=exchange, kernels=kernels, launches=count.launches)
                    rows.append(row | dict(bytes=count.moved_bytes))
    return rows


def launch_markdown(rows: list[dict], world: int, dim: int, chunk: int) -> str:
    lines = [
        f"**Launches and bytes per step** (one rank of P = {world}, d = {dim}, T = {chunk}; counted on the meta "
        "device, the same on any device; bytes: each launch's tensors read and written once; torch tiles in "
        "float32, kernels in bf16)",
        "",
        "| N | loss | exchange | torch tiles: launches | GiB | kernels: launches | GiB | triton-mm: launches | GiB |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    by = {(r["n"], r["loss"], r["exchange"], r["kernels"]): r for r in rows}
    for n, loss, exchange in dict.fromkeys((r["n"], r["loss"], r["exchange"]) for r in rows):
        cells = [f"{n}", loss, exchange]
        for kernels in ("torch", "triton", "triton-mm"):
            r = by[n, loss, exchange, kernels]
            cells += [f"{r['launches']:,}", f"{r['bytes'] / 2**30:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    world, dim, chunk = 8, 1024, 1024
    print(launch_markdown(count_launches([4096, 65536], world, dim, chunk), world, dim, chunk))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
