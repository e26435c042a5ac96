"""Two dimensions: data parallel x tensor parallel on a dp x tp `DeviceMesh`.

`init_device_mesh(device, (dp, tp), mesh_dim_names=("dp", "tp"))` lays the P = dp tp ranks out as a
grid, rank = i_dp tp + i_tp: each row of the grid is a tensor-parallel group (the block split over tp
ranks, the operators f and g on that group), each column a data-parallel group (the same shard of the
block on every rank of it, each with its N / dp rows of the batch). One step: forward and backward
within the row, then every gradient all-reduced down the column. The loss share of a rank is its rows'
part of the whole batch's mean, so the column SUMS (no 1/dp: each share was divided by the whole
batch's count already; the same as DDP's average of means).

Bytes per rank and step: tensor parallel 2(tp-1)/tp (N/dp) seq d e per all-reduce, two each way
(attention, MLP; on its own rows: `cost.expected_traffic` of the block on N/dp rows over tp ranks), data
parallel 2(dp-1)/dp Psi_r e, Psi_r the rank's parameter count.
"""

from __future__ import annotations

from dataclasses import replace

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from distlab.comm.collectives import ring_fraction
from distlab.layer_split.tensor_parallel.blocks import ParallelBlock
from distlab.layer_split.tensor_parallel.cost import expected_traffic
from distlab.layer_split.tensor_parallel.model import BlockConfig, build, dropout_masks
from distlab.layer_split.tensor_parallel.operators import all_reduce, tensor_parallel
from distlab.layer_split.tensor_parallel.runs import LayerBatch, sgd_steps
from distlab.proof.training import Run, reduce_gradients


def mesh_shape(world_size: int) -> tuple[int, int]:
    """(dp, tp): tp = 2 where P is even (2 x 2 at P = 4), else pure data parallelism."""
    tp = 2 if world_size % 2 == 0 else 1
    return world_size // tp, tp


def check_mesh(cfg: BlockConfig, world_size: int) -> None:
    dp, tp = mesh_shape(world_size)
    if cfg.batch % dp:
        raise ValueError(
            f"--global-batch: N = {cfg.batch} does not split over dp = {dp} data-parallel "
            f"groups (the {dp} x {tp} mesh at P = {world_size})"
        )


def two_d_step(rt, cfg: BlockConfig, lr: float) -> tuple[Run, ParallelBlock, dict]:
    """One SGD step of the block on the dp x tp mesh: (the run, the split block, where this rank sits)."""
    dp, tp = mesh_shape(rt.world_size)
    mesh = init_device_mesh(rt.device.type, (dp, tp), mesh_dim_names=("dp", "tp"))
    i_dp, i_tp = mesh.get_local_rank("dp"), mesh.get_local_rank("tp")
    comm = tensor_parallel(mesh.get_group("tp"))
    block, x, target = build(cfg)
    model = ParallelBlock(block, i_tp, tp, comm).to(rt.device)

    def rows(t):
        return t.chunk(dp, dim=0)[i_dp].contiguous().to(rt.device)

    masks = dropout_masks(cfg, 0)
    batch = LayerBatch(rows(x), rows(target), x.numel(), [tuple(map(rows, masks)) if masks else None])
    dp_group = mesh.get_group("dp")
    params = list(model.parameters())  # summed down the column in one message: every gradient of the shard
    run = sgd_steps(
        model,
        batch,
        1,
        lr,
        lambda: reduce_gradients(params, lambda flat: all_reduce(flat, dp_group, comm.ledger, "data parallel")),
    )
    where = {
        "dp": dp,
        "tp": tp,
        "i_dp": i_dp,
        "i_tp": i_tp,
        "tp_ranks": dist.get_process_group_ranks(comm.group),
        "dp_ranks": dist.get_process_group_ranks(dp_group),
    }
    return run, model, where


def expected_2d_traffic(cfg: BlockConfig, world_size: int, shard_numel: int) -> dict:
    """Bytes a rank sends in one 2-D step: the block's tensor parallelism on its N/dp rows over tp ranks
    (`cost.expected_traffic`), then the all-reduce of its shard's gradients over dp ranks."""
    dp, tp = mesh_shape(world_size)
    out = expected_traffic(replace(cfg, batch=cfg.batch // dp), "block", tp, sequence_parallel=False)
    out["data parallel", "all_reduce"] = ring_fraction("all_reduce", dp) * shard_numel * cfg.dtype.itemsize
    return out
