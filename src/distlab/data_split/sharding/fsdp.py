"""FSDP2 (`torch.distributed.fsdp.fully_shard`) on the lesson's model, as a strategy for the loop of
`distlab.data_split.sharding.training`: one `fully_shard` per layer (a layer's weights are all-gathered as one
group, like ZeRO-3's flat unit), then one on the root. Its parameters become DTensors sharded on
dim 0 (`Shard(0)`): rank r keeps rows r ceil(rows/P) .. of every parameter, each padded to
ceil(rows/P) rows, so its bytes per rank are e sum_params ceil(rows/P) x (the other dims).

How its options map onto the stages written by hand:

    fully_shard(layer)                  ZeRO-3: gathered before forward, freed after it,
                                        gathered again for backward
    reshard_after_forward=False         ZeRO-3 keeping the gathered layer from forward to its
                                        backward (one all-gather less, more memory between)
    reshard_after_forward=k (an int)    after forward, resharded over k ranks (a smaller gather)
    MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=float32)
                                        the float32 shards are the master copy; bf16 is
                                        gathered and computed with, gradients reduced in float32
    set_requires_gradient_sync(False)   no reduce-scatter: accumulate whole gradients (no_sync)
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from distlab.data_split.sharding.problem import ShardingConfig, optimizer_of
from distlab.data_split.sharding.shards import broadcast_model
from distlab.processes.console import print0, rows_table
from distlab.processes.identity import Runtime
from distlab.proof.held import model_states
from distlab.proof.verdict import Verdict


def shard_model(
    model: nn.Module, mesh: DeviceMesh, reshard_after_forward: bool = True, compute_dtype: torch.dtype | None = None
) -> nn.Module:
    """fully_shard each layer that holds parameters of its own, then the root, which takes the rest: the
    model's own parameters (`logit_scale`) and every child that shares one with another (a tied embedding and
    output: FSDP2 refuses a parameter in two groups). `compute_dtype` (bf16): gathered and computed in it,
    the float32 shards the master weights, gradients reduced in the shards' dtype (MixedPrecisionPolicy)."""
    options = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if compute_dtype is not None:
        reduce_dtype = next(model.parameters()).dtype
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=reduce_dtype)
    everywhere = model.named_parameters(remove_duplicate=False)
    holders: dict[int, set[str]] = {}
    for name, p in everywhere:
        holders.setdefault(id(p), set()).add(name.split(".")[0] if "." in name else "")
    for name, layer in model.named_children():
        own = list(layer.parameters())
        if own and all(holders[id(p)] == {name} for p in own):
            fully_shard(layer, **options)
    return fully_shard(model, **options)


def fsdp_held(model: nn.Module, world: int, rank: int, e: int) -> dict[str, int]:
    """What rank `rank` of P = `world` holds after a step under FSDP2, by item, for e bytes per element
    (`fsdp_states` on the model's parameters)."""
    return fsdp_states([(q.shape[0], q.numel() // q.shape[0]) for q in model.parameters()], world, rank, e)


def fsdp_states(params: list[tuple[int, int]], world: int, rank: int, e: int) -> dict[str, int]:
    """The same by the parameters' sizes alone, each (rows, elements per row) (what a cost model knows).
    Weights and gradients: each parameter's shard padded to ceil(rows / P) rows; AdamW's moments are made
    like the local shard, which is unpadded: rank r's real rows, min(ceil(rows/P), rows - r ceil(rows/P)),
    at least 0."""

    def rows(total: int, padded: bool) -> int:
        per = math.ceil(total / world)
        return per if padded else max(0, min(per, total - rank * per))

    padded = e * sum(rows(r, True) * cols for r, cols in params)
    local = e * sum(rows(r, False) * cols for r, cols in params)
    return {"weights": padded, "gradients": padded, "moments": 2 * local, "step counts": 4 * len(params)}


class Fsdp2:
    """A trainee of the one training loop (`distlab.proof.training.train`) around a fully_shard'ed model."""

    ring = None  # FSDP2's collectives run inside torch: not counted by a ring of ours

    def __init__(
        self,
        model: nn.Module,
        rt: Runtime,
        cfg: ShardingConfig,
        reshard_after_forward: bool = True,
        mesh: DeviceMesh | None = None,
    ):
        mesh = mesh if mesh is not None else init_device_mesh(rt.device.type, (rt.world_size,))
        broadcast_model(model, mesh.get_group())  # one model on the mesh (fully_shard keeps each rank's own rows)
        self.model = shard_model(model, mesh, reshard_after_forward, cfg.compute)
        self.optimizer = optimizer_of(self.model.parameters(), cfg)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def after_backward(self) -> None:
        pass

    def after_step(self) -> None:
        pass

    def items(self) -> dict[str, list[torch.Tensor]]:
        params = list(self.model.parameters())
        states = [{k: _local(v) for k, v in self.optimizer.state[p].items()} for p in params]
        grads = [None if p.grad is None else p.grad.to_local() for p in params]
        return model_states([p.to_local() for p in params], grads, states)

    def params(self) -> dict[str, torch.Tensor]:
        return {n: p.full_tensor().cpu() for n, p in self.model.named_parameters()}

    def grads(self) -> dict[str, torch.Tensor]:
        return {
            n: (torch.zeros(p.shape, dtype=p.dtype) if p.grad is None else p.grad.full_tensor().cpu())
            for n, p in self.model.named_parameters()
        }

    def states(self) -> dict[str, dict[str, torch.Tensor]]:
        return {
            n: {
                k: (v.full_tensor() if hasattr(v, "full_tensor") else v).cpu().clone()
                for k, v in self.optimizer.state[p].items()
            }
            for n, p in self.model.named_parameters()
        }


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard; a plain tensor (AdamW's step count) as it is."""
    return t.to_local() if hasattr(t, "to_local") else t


def show_reshard(gathers: dict[bool, int], model, verdict: Verdict) -> None:
    """What reshard_after_forward changes: not what a rank holds after the step (the rows above are equal),
    but the step itself: False keeps each gathered layer from its forward to its backward (memory FSDP2
    frees by resizing, which PeakMemory cannot see) and so its backward gathers nothing again."""
    if not gathers:
        print0("At P = 1 FSDP2 gathers nothing: run at P >= 2 to see what reshard_after_forward changes.")
        return
    layers = sum(1 for m in model.modules() if any(p.requires_grad for p in m.parameters(recurse=False)))
    print0(
        rows_table(
            "What reshard_after_forward changes: all-gathers per step",
            ("reshard_after_forward", "all-gathers", "the gathered layer"),
            [
                ("True", f"{gathers[True]}", "freed after forward, gathered again"),
                ("False", f"{gathers[False]}", "kept from forward to backward"),
            ],
        )
    )
    verdict.check(
        f"reshard_after_forward=False saves the backward's all-gathers ({layers} layers)",
        gathers[False] == layers and gathers[True] == 2 * layers,
        f"{gathers[True]} -> {gathers[False]}",
    )
