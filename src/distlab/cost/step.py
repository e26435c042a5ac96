"""A step's cost, everything the cost model knows about one configuration, per rank: FLOPs, bytes held,
bytes sent. Nothing here is new arithmetic: it gathers `flops`, `memory` and `traffic` for each pipeline
position (every data-, tensor- and context-parallel rank of a position does the same work and holds the same
bytes: ZeRO's shards are padded to equal size, tensor parallelism cuts heads and d_ff evenly, the zig-zag
ring gives every rank equal work).

    cost = step_cost(Transformer(4, 64, 4, 256), Batch(16, 32), Parallel(ParallelDims(dp=2, tp=2)), "float32")
    cost.ranks[0].memory["weights"], cost.ranks[0].traffic.sent["tp", "all_reduce"], cost.model_flops
"""

from __future__ import annotations

from dataclasses import dataclass

from distlab.cost import flops, memory, traffic
from distlab.cost.inputs import Batch, Mlp, Parallel
from distlab.cost.rules import check
from distlab.proof.sizes import Transformer


@dataclass(frozen=True)
class RankCost:
    """One pipeline position's rank: its FLOPs, what it holds (bytes by item), what it sends."""

    pp_rank: int
    flops: flops.Flops
    memory: dict[str, int]
    traffic: traffic.Traffic

    @property
    def held(self) -> int:
        return sum(self.memory.values())


@dataclass(frozen=True)
class StepCost:
    model: Transformer | Mlp
    batch: Batch
    parallel: Parallel
    precision: str
    ranks: list[RankCost]  # one per pipeline position
    model_flops: int  # forward + backward of the global batch: MFU's numerator

    @property
    def hardware_flops(self) -> int:
        """Every FLOP every rank computes, recomputation included: HFU's numerator."""
        p = self.parallel
        return p.dp * p.tp * p.cp * sum(r.flops.hardware for r in self.ranks)

    @property
    def peak_held(self) -> int:
        """The most any rank holds: the memory the configuration needs per device."""
        return max(r.held for r in self.ranks)


def step_cost(
    model: Transformer | Mlp, batch: Batch, parallel: Parallel, precision: str, device_type: str = "cpu"
) -> StepCost:
    """The cost of one step, checked first (`rules.check`: one line naming the field that cannot work).
    `device_type`: where the LayerNorm statistics' dtype is decided (on CUDA float32 under bf16)."""
    check(model, batch, parallel, precision)
    ranks = [
        RankCost(
            r,
            flops.rank_flops(model, batch, parallel, r),
            memory.per_rank(model, batch, parallel, precision, r, device_type),
            traffic.per_rank(model, batch, parallel, precision, r),
        )
        for r in range(parallel.pp)
    ]
    return StepCost(model, batch, parallel, precision, ranks, flops.model_flops(model, batch))
