"""The cost model's memory and bytes equal what the lessons measure on real ranks, exact integers.

Each measurement is the lessons' own code run on spawned ranks here (gloo, float64), at the lessons'
default sizes, at P = 3 (uneven ZeRO shards) and P = 4 (the 2 x 2 mesh): lesson 06's ring all-reduce of a
gradient; lesson 07's DDP and ZeRO-1, -2, -3 by hand (every item held, every byte sent); lesson 08's block
under tensor and sequence parallelism (bytes and calls per collective, activations kept) and its dp x tp
step; lesson 09's ring attention (bytes forward and backward); lessons 02-03's GPipe and 1F1B (micro-batches
in flight, saved bytes at the peak, bytes sent between stages). And without processes, lesson 07's "what a
step holds" (the MLP and the block, float64 and mixed precision). The predictions come from sizes alone:
`distlab.cost` never sees the models."""

from __future__ import annotations

from argparse import Namespace
from collections import Counter

import pytest
import torch
from helpers import load_lesson

from distlab.comm.ledger import Ledger
from distlab.composed.dims import ParallelDims
from distlab.cost import memory, traffic
from distlab.cost.inputs import PRECISIONS, Batch, Mlp, Parallel
from distlab.data_split.data_parallel.measure import measure_collectives
from distlab.data_split.sharding import holds
from distlab.data_split.sharding.problem import ShardingConfig, build_model, global_batch, rows_of
from distlab.data_split.sharding.replicated import Replicated
from distlab.data_split.sharding.training import run_strategy
from distlab.layer_split.context_parallel.split import Layout
from distlab.layer_split.tensor_parallel import mesh2d, operators
from distlab.layer_split.tensor_parallel.model import BlockConfig
from distlab.layer_split.tensor_parallel.runs import activation_bytes_measured, split_run
from distlab.model_split import p2p
from distlab.model_split.runner import PipelineStep
from distlab.model_split.training import PipelineConfig
from distlab.processes.spawn import spawn
from distlab.proof.models import Block, BlockOptions, token_batch
from distlab.proof.sizes import Transformer

SHARDING = ShardingConfig()  # lesson 07: layers of 221, 154, 60 parameters, N = 24, AdamW, float64
BLOCK = BlockConfig()  # lesson 08: N = 12, seq = 12, d = 24, h = 12, d_ff = 48, dropout 0.1, float64
RING = Namespace(seed=0, heads=2, seq_len=48, head_dim=16, dtype="float64")  # lesson 09's defaults
PIPE = dict(global_batch=16, micro_batches=4, probe=True)  # lessons 02-03's MLP of 8 layers, M = 4
GRADIENT_BYTES = 8 * 4 * 1000  # a gradient of 4,000 float64 elements, all-reduced by lesson 06's ring


def _counted_post(ledger: Ledger):
    """`distlab.comm.p2p.post` with a ledger: every message the pipeline hands to the transport, counted."""
    post = p2p.post

    def counting(sends, receives, group=None, _ledger=None, tag=0):
        return post(sends, receives, group, ledger, tag)

    return counting


def _pipeline(rt, schedule: str) -> dict:
    ledger, original = Ledger(), p2p.post
    p2p.post = _counted_post(ledger)
    try:
        step = PipelineStep(rt, PipelineConfig(schedule=schedule, **PIPE))
        step(0)
    finally:
        p2p.post = original
    return step.measurements() | {"sent": ledger.sent}


def _measure(rt) -> dict:
    """Every measurement, on this rank."""
    lesson07 = load_lesson("07_sharding")
    out = {"06 all_reduce": next(r for r in measure_collectives(rt, GRADIENT_BYTES, torch.float64, 0, 1))}
    for stage, make in {"DDP": Replicated, **lesson07.BY_HAND}.items():
        run = run_strategy(rt, SHARDING, make)
        out["07", stage] = (run.held, run.sent)
    for name, make in (("TP", operators.tensor_parallel), ("TP + SP", operators.sequence_parallel)):
        outcome = split_run(rt, BLOCK, "block", make(), 1, 0.1)
        saved, _ = activation_bytes_measured(rt, BLOCK, make())
        out["08", name] = (Counter(outcome.ledger.sent_by), Counter(outcome.ledger.calls), saved)
    if rt.world_size == 4:
        _, model, _ = mesh2d.two_d_step(rt, BLOCK, 0.1)
        out["08 2-D"] = Counter(model.attn.comm.ledger.sent_by)
    lesson09 = load_lesson("09_context_parallel")
    layout = Layout(rt.world_size, RING.seq_len, "zigzag", True)
    out["09"] = lesson09.run_ring(rt, lesson09.make_inputs(RING), layout).sent
    for schedule in ("gpipe", "1f1b"):
        out["pipeline", schedule] = _pipeline(rt, schedule)
    return out


@pytest.fixture(scope="module", params=[3, 4], ids=lambda p: f"P{p}")
def measured(request) -> tuple[int, list[dict]]:
    return request.param, spawn(_measure, request.param, timeout_s=120, limit_s=300)


def _by_dimension(t: traffic.Traffic, dim: str) -> dict[str, int]:
    return {kind: n for (d, kind), n in t.sent.items() if d == dim}


def _phases_summed(counter: Counter) -> Counter:
    """A ledger's (phase, collective) entries, summed per collective (the cost model's key)."""
    out = Counter()
    for (_, kind), n in counter.items():
        out[kind] += n
    return out


def test_lesson06_ring_all_reduce_sends_what_a_one_layer_ddp_step_does(measured):
    p, ranks = measured
    row = ranks[0]["06 all_reduce"]
    assert row.name == "all_reduce" and row.counted_bytes == row.formula_bytes
    elements = row.full_bytes // 8  # a one-unit model of as many parameters (a Linear of elements - 1 inputs)
    sent = traffic.per_rank(Mlp((elements - 1, 1)), Batch(p), Parallel(ParallelDims(dp=p)), "float64")
    assert sent.sent["dp", "all_reduce"] == row.counted_bytes


@pytest.mark.parametrize("stage", ["DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3"])
def test_lesson07_every_item_held_and_byte_sent_equal_the_cost_model(measured, stage):
    p, ranks = measured
    model, batch, parallel = (
        Mlp(SHARDING.widths),
        Batch(SHARDING.global_batch),
        Parallel(ParallelDims(dp=p), zero=stage),
    )
    states = memory.model_states(memory.rank_units(model, parallel, 0, batch), stage, p, PRECISIONS["float64"])
    sent = traffic.per_rank(model, batch, parallel, "float64").total
    for held, counted in (rank[("07", stage)] for rank in ranks):
        assert (held, counted) == (states, sent)


def test_lesson08_block_bytes_calls_and_activations_equal_the_cost_model(measured):
    p, ranks = measured
    model = BLOCK.model
    for name, sp in (("TP", False), ("TP + SP", True)):
        parallel = Parallel(ParallelDims(tp=p), sp=sp)
        predicted = traffic.per_rank(model, Batch(BLOCK.batch, BLOCK.seq), parallel, "float64")
        kept = memory.block_activations(model, Batch(BLOCK.batch, BLOCK.seq), parallel, 8, 8)
        for sent_by, calls, saved in (rank[("08", name)] for rank in ranks):
            assert _phases_summed(sent_by) == _by_dimension(predicted, "tp")
            assert _phases_summed(calls) == {k: n for (d, k), n in predicted.calls.items() if d == "tp"}
            assert saved == kept


def test_lesson08_two_d_step_sends_what_the_cost_model_says(measured):
    p, ranks = measured
    if p != 4:
        pytest.skip("the 2 x 2 mesh needs P = 4")
    dp, tp = mesh2d.mesh_shape(p)
    predicted = traffic.per_rank(
        BLOCK.model, Batch(BLOCK.batch, BLOCK.seq), Parallel(ParallelDims(dp, tp=tp)), "float64"
    )
    for rank in ranks:
        counted = rank["08 2-D"]
        assert _phases_summed({k: v for k, v in counted.items() if k[0] != "data parallel"}) == _by_dimension(
            predicted, "tp"
        )
        assert counted["data parallel", "all_reduce"] == predicted.sent["dp", "all_reduce"]


def test_lesson09_ring_bytes_equal_the_cost_model(measured):
    p, ranks = measured
    model = Transformer(1, RING.heads * RING.head_dim, RING.heads, 1)
    forward = traffic.per_rank(model, Batch(1, RING.seq_len), Parallel(ParallelDims(cp=p)), "float64").sent[
        "cp", "ring"
    ]
    for sent in (rank["09"] for rank in ranks):
        assert sum(sent) == forward  # one attention's forward and backward ring, one sequence


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_in_flight_saved_bytes_and_sends_equal_the_cost_model(measured, schedule):
    p, ranks = measured
    widths = PipelineConfig().widths
    model, batch = Mlp(widths), Batch(PIPE["global_batch"], 1, PIPE["micro_batches"])
    parallel = Parallel(ParallelDims(pp=p), schedule=schedule)
    for r, got in enumerate(ranks):
        got = got["pipeline", schedule]
        assert got["peak_in_flight"] == memory.in_flight(parallel, batch, r)
        assert got["saved_peak_bytes"] == memory.activations(model, batch, parallel, PRECISIONS["float64"], r, 8)
        assert got["sent"] == traffic.per_rank(model, batch, parallel, "float64", r).total


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_lesson07_what_a_step_holds_equals_the_cost_model(world_size):
    """Lesson 07, part 1, on one rank's C = N / P rows: its MLP and its block (q, k, v fused, attention
    written out), float64 and mixed precision. The one-block model's input and target are counted by the
    lesson, not the block (in a stack they are the previous block's output and the loss's)."""
    c = SHARDING.global_batch // world_size
    seq, d, heads = 8, 16, 2
    cases = {
        "mlp": (Mlp(SHARDING.widths), Batch(c), lambda: build_model(SHARDING), global_batch(SHARDING, 0), 0),
        "block": (
            Transformer(1, d, heads, 4 * d, attention="written", fused_qkv=True),
            Batch(c, seq),
            lambda: Block(d, heads, 4 * d, BlockOptions(fused_qkv=True, sdpa=False)),
            token_batch(SHARDING.global_batch, seq, d, 0, SHARDING.dtype),
            2 * c * seq * d,  # the lesson's input and target
        ),
    }
    rt = Namespace(rank=0, world_size=world_size, device=torch.device("cpu"))
    for model, batch, build, data, loose in cases.values():
        x, target = (rows_of(t, rt) for t in data)
        for measure, precision in ((holds.measure_one_dtype_step, "float64"), (holds.measure_mixed_step, "bf16")):
            got = measure(build, x, target).items
            e = PRECISIONS[precision].e
            predicted = memory.per_rank(model, batch, Parallel(), precision)
            predicted["activations"] += e * loose
            del predicted["buffers"]
            assert got == predicted, (precision, got, predicted)
