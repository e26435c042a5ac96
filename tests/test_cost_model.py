"""The cost model's formulas, checked without processes: FLOPs against torch's own FLOP counter
(`torch.utils.flop_counter.FlopCounterMode`) on the block stack at several shapes, forward, backward and
recomputation; parameters against the published Llama 3 counts; the model's FLOPs conserved by every
split; mixed precision's states against lesson 07's and the ZeRO paper's; and every impossible input
refused in one line naming its field. (What real ranks hold and send: tests/test_cost_measured.py.)"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode

from distlab.composed.dims import ParallelDims
from distlab.cost import flops, memory
from distlab.cost.inputs import Batch, Mlp, Parallel
from distlab.cost.rules import check
from distlab.cost.step import step_cost
from distlab.data_split.sharding import accounting
from distlab.plan.presets import MODELS
from distlab.proof.models import Block, BlockOptions, layered_mlp, regression_batch, token_batch
from distlab.proof.sizes import Transformer

# (layers, d, h, d_ff, N, seq, attention, fused qkv, causal, recompute)
SHAPES = [
    (2, 32, 4, 128, 3, 16, "written", True, False, False),
    (3, 24, 2, 40, 2, 10, "sdpa", False, True, True),
    (1, 16, 1, 16, 5, 7, "written", False, True, True),
    (2, 48, 6, 96, 1, 24, "sdpa", True, False, False),
]


def counted(shape) -> tuple[int, int]:
    """(forward, backward with recomputation) FLOPs of the block stack, by FlopCounterMode. torch's fused
    attention runs as its math backend here, so the counter sees its products (on the CPU the fused
    kernel's are not registered with it)."""
    layers, d, h, ffn, n, seq, attention, fused, causal, recompute = shape
    options = BlockOptions(causal=causal, fused_qkv=fused, sdpa=attention == "sdpa")
    stack = nn.Sequential(*[Block(d, h, ffn, options, seed=i) for i in range(layers)])
    x, target = token_batch(n, seq, d)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        out = x
        for block in stack:
            out = checkpoint(block, out, use_reentrant=False) if recompute else block(out)
        forward = counter.get_total_flops()
        ((out - target) ** 2).mean().backward()
    return forward, counter.get_total_flops() - forward


def predicted(shape) -> flops.Flops:
    layers, d, h, ffn, n, seq, attention, fused, _, recompute = shape
    model = Transformer(layers, d, h, ffn, attention=attention, fused_qkv=fused)
    return flops.rank_flops(model, Batch(n, seq), Parallel(recompute=recompute))


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"L{s[0]}-d{s[1]}-h{s[2]}-{s[6]}-rec{int(s[9])}")
def test_block_stack_flops_equal_the_flop_counter(shape):
    forward, backward = counted(shape)
    cost = predicted(shape)
    assert (cost.forward, cost.backward + cost.recompute) == (forward, backward)
    assert cost.model == 3 * cost.forward  # backward: two products per forward product


def test_the_flop_check_can_fail():
    """Wrong answers it rejects: causal attention counted half, recomputation counted whole (no early stop)."""
    shape = SHAPES[1]
    forward, backward = counted(shape)
    model = Transformer(*shape[:4], attention=shape[6])
    rows, seq = shape[4], shape[5]
    half = flops.attention_forward(model, rows, seq) // 2
    assert predicted(shape).forward - model.layers * half != forward
    whole = predicted(shape).backward + model.layers * flops.block_forward(model, rows, seq)
    assert whole != backward


def test_layered_mlp_flops_skip_the_data_gradient():
    """The first Linear's input is data: backward computes its weight's gradient, not the input's."""
    widths = (16, 32, 8, 4)
    model = layered_mlp(widths)
    x, y = regression_batch(10, 16, 4)
    with FlopCounterMode(display=False) as counter:
        ((model(x) - y) ** 2).mean().backward()
    cost = flops.rank_flops(Mlp(widths), Batch(10), Parallel())
    assert cost.model == counter.get_total_flops()
    assert cost.backward == 2 * cost.forward - 2 * 10 * 16 * 32


@pytest.mark.parametrize(
    "name,count", [("llama3-8b", 8_030_261_248), ("llama3-70b", 70_553_706_496), ("llama3-405b", 405_853_388_800)]
)
def test_llama_parameters_equal_the_published_counts(name, count):
    assert MODELS[name].parameters == count


SPLITS = [
    Parallel(ParallelDims(dp=2, tp=2)),
    Parallel(ParallelDims(tp=4, cp=2), sp=True),
    Parallel(ParallelDims(pp=2, dp=2), zero="ZeRO-3"),
    Parallel(ParallelDims(pp=2, tp=2), schedule="interleaved-1f1b", stages_per_rank=2, cut_gathered=True, sp=True),
]


@pytest.mark.parametrize("parallel", SPLITS, ids=lambda p: p.label())
def test_every_split_computes_the_models_flops(parallel):
    """Summed over every rank, a split computes exactly the unsplit step's forward and backward."""
    model, batch = Transformer(8, 64, 8, 256, vocab=96), Batch(8, 32, 4)
    cost = step_cost(model, batch, parallel, "float32")
    per_position = parallel.dp * parallel.tp * parallel.cp
    assert per_position * sum(r.flops.model for r in cost.ranks) == cost.model_flops
    assert cost.model_flops == flops.model_flops(model, batch)


def test_mixed_precision_states_are_lesson_07s_and_the_zero_papers():
    """DDP: lesson 07's mixed step (2 + 2 + 4 + 8 bytes a parameter); ZeRO-1, -2, -3 with dp dividing every
    unit: ZeRO-2's and -3's the ZeRO paper's 2 + 14/dp, 16/dp bytes a parameter, besides 4-byte step counts;
    ZeRO-1 Megatron-LM's distributed optimizer's 4 + 16/dp (bf16 gradients, a float32 main-gradient shard)."""
    model, dp = Transformer(2, 64, 4, 256), 4
    units = memory.rank_units(model, Parallel(ParallelDims(dp=dp)), 0, Batch(8))
    psi, tensors = model.parameters, len(model.block_weights()) * model.layers
    ddp = memory.model_states(units, "DDP", dp, memory.PRECISIONS["bf16"])
    assert ddp == accounting.expected_states_mixed(psi, tensors)
    for zero, per_parameter in (("ZeRO-1", 4 + 16 / dp), ("ZeRO-2", 2 + 14 / dp), ("ZeRO-3", 16 / dp)):
        held = memory.model_states(units, zero, dp, memory.PRECISIONS["bf16"])
        assert sum(held.values()) - held["step counts"] == per_parameter * psi


BAD = [
    (dict(parallel=Parallel(ParallelDims(tp=3))), "tp: tp = 3 does not divide heads = 8"),
    (dict(parallel=Parallel(ParallelDims(cp=3))), "cp: the zig-zag ring cuts seq = 32 into 2 cp = 6 pieces"),
    (dict(parallel=Parallel(ParallelDims(dp=2, ep=2))), "ep: expert parallelism needs a mixture-of-experts model"),
    (dict(parallel=Parallel(zero="ZeRO-4")), "zero: 'ZeRO-4' is not one of DDP, ZeRO-1, ZeRO-2, ZeRO-3"),
    (dict(parallel=Parallel(ParallelDims(pp=9))), "pp: pp x v = 9 stages, but only 8 layers"),
    (dict(parallel=Parallel(ParallelDims(dp=3))), "dp: N = 8 sequences do not split over dp = 3"),
    (
        dict(batch=Batch(8, 32, 3), parallel=Parallel(ParallelDims(dp=2))),
        "micro_batches: N / dp = 4 sequences per data-parallel",
    ),
    (
        dict(parallel=Parallel(ParallelDims(tp=2), sp=True), batch=Batch(8, 33)),
        "tp: sequence parallelism cuts seq / cp = 33",
    ),
    (dict(parallel=Parallel(ParallelDims(pp=2), schedule="nope")), "schedule: unknown schedule 'nope'"),
    (dict(parallel=Parallel(ParallelDims(tp=2), cut_gathered=True)), "cut_gathered: only sequence parallelism"),
    (dict(precision="fp4"), "precision: 'fp4' is not one of float64, float32, bf16, fp8"),
    (dict(model=Transformer(8, 64, 6, 256)), "heads: h = 6 does not divide d = 64"),
    (
        dict(model=Transformer(8, 64, 8, 256, attention="written"), parallel=Parallel(ParallelDims(tp=2))),
        "attention: written",
    ),
    (dict(model=Mlp((16, 8)), parallel=Parallel(ParallelDims(tp=2))), "tp: the layered MLP has no heads"),
    (dict(batch=Batch(8, 0)), "seq: must be a positive integer, got 0"),
]


@pytest.mark.parametrize("bad,message", BAD, ids=[m.split(":")[0] for _, m in BAD])
def test_impossible_inputs_are_refused_in_one_line(bad, message):
    args = dict(model=Transformer(8, 64, 8, 256), batch=Batch(8, 32), parallel=Parallel(), precision="float32") | bad
    with pytest.raises(ValueError) as err:
        check(**args)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_a_good_configuration_passes_the_check():
    check(Transformer(8, 64, 8, 256), Batch(8, 32, 2), Parallel(ParallelDims(dp=2, tp=2, pp=2, cp=2), sp=True), "bf16")
    assert torch.bfloat16 in memory.DTYPE_OF.values()
