"""The planner's models as practitioners write them, each count held to an independent one: parameters of
GPT-2 against torch's own modules (tied embeddings), DeepSeek-V3 against its published 671 B and 37 B, a
mixture of experts against the count written out; expert parallelism's all-to-all against lesson 10's rows
that leave a rank; float32 gradients at 18 bytes a parameter; attention with unequal q k and v widths (MLA)
against torch's FLOP counter; the time model's tile and wave quantisation and causal half; the
activations of torch's math attention path (the softmax kept) against what autograd saves on this CPU; one
rank order (lesson 12's mesh groups decide the planner's links); ZeRO-1 against Megatron-LM's distributed
optimizer's bytes per parameter, item by item."""

from __future__ import annotations

import json
from dataclasses import replace
from fractions import Fraction

import pytest
import torch
import torch.nn.functional as F
from helpers import lesson_path, load_lesson
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from distlab.composed.dims import ParallelDims
from distlab.cost import flops, memory, schedule, traffic
from distlab.cost.inputs import DEEPSEEK_V3_MEASURES, PRECISIONS, Batch, Parallel
from distlab.cost.step import step_cost
from distlab.cost.timing import Assumptions, gemm_efficiency, predict
from distlab.layer_split.tensor_parallel.cost import activation_bytes
from distlab.layer_split.tensor_parallel.model import BlockConfig
from distlab.model_split.simulator import peak_in_flight, simulate
from distlab.plan.cli import main
from distlab.plan.presets import MODELS
from distlab.plan.report import ITEMS
from distlab.processes.console import console
from distlab.proof.hardware import GIB, cluster
from distlab.proof.held import SavedActivations
from distlab.proof.models import Block, BlockOptions, token_batch
from distlab.proof.sizes import Transformer

GPT2 = [
    *("--layers 12 --dim 768 --heads 12 --ffn-width 3072 --vocab 50304 --tied-embeddings --seq-len 1024".split()),
    *("--global-batch 480 --gpu a100-40gb --gpus 8 --layout dp=8".split()),
]


class TinyGpt(nn.Module):
    """GPT-2's shape in torch modules (no position embedding: rotary, or counted apart), its head tied."""

    def __init__(self, vocab: int, d: int, layers: int, ffn: int):
        super().__init__()
        self.embedding = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(
            nn.ModuleDict(
                dict(
                    ln1=nn.LayerNorm(d),
                    qkv=nn.Linear(d, 3 * d),
                    out=nn.Linear(d, d),
                    ln2=nn.LayerNorm(d),
                    fc1=nn.Linear(d, ffn),
                    fc2=nn.Linear(ffn, d),
                )
            )
            for _ in range(layers)
        )
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embedding.weight  # tied: one matrix


def test_gpt2_counts_124m_parameters_as_torch_does():
    small = TinyGpt(96, 16, 3, 64)
    assert Transformer(3, 16, 4, 64, 96, tied=True).parameters == sum(p.numel() for p in small.parameters())
    assert Transformer(3, 16, 4, 64, 96).parameters != sum(p.numel() for p in small.parameters())  # untied: twice
    d, layers, vocab = 768, 12, 50304
    assert MODELS["gpt2-124m"].parameters == vocab * d + layers * (12 * d * d + 13 * d) + 2 * d == 123_689_472


def test_the_gpt2_command_prints_and_writes_its_memory_items(tmp_path):
    path = tmp_path / "gpt2.json"
    with console.capture() as captured:
        code = main([*GPT2, "--json", str(path)])
    out, result = captured.get(), json.loads(path.read_text())
    assert code == 0 and "124 M parameters" in out and "dp8 ZeRO-1" in out
    assert {"step_s", "mfu", "hfu", "memory_gib", "memory"} <= set(result) and tuple(result["memory"]) == ITEMS
    assert result["memory_gib"] == pytest.approx(sum(result["memory"].values()), rel=1e-12)
    assert result["memory"]["reserve"] == 4.0 and result["fits"] and 0 < result["mfu"] == result["hfu"] < 1
    assert all(item in out for item in ITEMS)


def test_deepseek_v3_is_expressible_within_one_percent():
    model = MODELS["deepseek-v3"]
    assert abs(model.parameters / 671e9 - 1) < 0.01
    assert abs(model.active_parameters / 37e9 - 1) < 0.02  # 37.55 B: the embedding's lookup counted as active


def test_a_mixture_of_experts_counts_as_written_out():
    d, f, e, layers, dense, shared, k = 64, 32, 8, 4, 1, 2, 2
    model = Transformer(layers, d, 4, 128, 0, gated=True, bias=False, rms_norm=True, experts=e, top_k=k,
                        expert_ffn=f, shared_experts=shared, dense_layers=dense)  # fmt: skip
    attention, norms = 4 * d * d, 2 * d
    expert = 3 * d * f
    dense_block = attention + norms + 3 * d * 128
    moe_block = attention + norms + e * d + shared * expert + e * expert
    assert model.parameters == dense * dense_block + (layers - dense) * moe_block
    active = dense * dense_block + (layers - dense) * (attention + norms + e * d + (shared + k) * expert)
    assert model.active_parameters == active


def moe(experts=8, top_k=2) -> Transformer:
    return Transformer(4, 64, 4, 128, 0, gated=True, bias=False, rms_norm=True, experts=experts, top_k=top_k,
                       expert_ffn=32, dense_layers=1)  # fmt: skip


def test_expert_parallelism_sends_the_rows_that_leave_a_rank():
    """Lesson 10's bytes with balanced routing: each of a micro-batch's T tokens sends top_k rows of d e,
    (ep - 1) / ep of them to other ranks, forward and back, and their gradients in backward: 4 ways."""
    model, batch = moe(), Batch(16, 32, 2)
    for ep in (2, 4):
        parallel = Parallel(ParallelDims(dp=4, ep=ep), zero="ZeRO-1")
        sent = traffic.per_rank(model, batch, parallel, "bf16").sent["ep", "all_to_all"]
        tokens = 16 // (4 * 2) * 32
        per_phase = tokens * model.top_k * (ep - 1) // ep * model.dim * 2
        assert sent == 4 * per_phase * 2 * 3  # four phases, two micro-batches, three MoE layers
    assert (
        traffic.per_rank(model, batch, Parallel(ParallelDims(dp=4), zero="ZeRO-1"), "bf16").sent["ep", "all_to_all"]
        == 0
    )


def test_experts_are_held_by_their_ep_rank_and_sharded_over_the_rest():
    model, batch = moe(), Batch(16, 32, 2)
    routed = [w.numel for unit in model.units() for w in unit if w.experts]
    dense = model.parameters - sum(routed)
    for ep in (1, 2, 4):
        held = memory.per_rank(model, batch, Parallel(ParallelDims(dp=4, ep=ep), zero="DDP"), "float32")["weights"]
        assert held == 4 * (dense + sum(routed) // ep)
        zero1 = memory.per_rank(model, batch, Parallel(ParallelDims(dp=4, ep=ep), zero="ZeRO-1"), "float32")["moments"]
        assert zero1 == 2 * 4 * (dense // 4 + sum(routed) // ep // (4 // ep))  # dp ranks; dp / ep for experts


def test_float32_gradients_hold_18_bytes_a_parameter_under_ddp():
    model = Transformer(2, 64, 4, 256)
    for grad_bytes, per in ((0, 16), (4, 18)):
        held = memory.per_rank(model, Batch(4, 8), Parallel(ParallelDims(dp=2), grad_bytes=grad_bytes), "bf16")
        states = sum(v for k, v in held.items() if k not in ("activations", "buffers", "step counts"))
        assert states == per * model.parameters
    bf16 = traffic.per_rank(model, Batch(4, 8), Parallel(ParallelDims(dp=2)), "bf16").total
    assert traffic.per_rank(model, Batch(4, 8), Parallel(ParallelDims(dp=2), grad_bytes=4), "bf16").total == 2 * bf16


def test_selective_recomputation_keeps_less_and_computes_the_same_products():
    model, batch = Transformer(4, 64, 4, 256, 100), Batch(4, 32, 2)
    held = {
        name: step_cost(model, batch, Parallel(**kw), "bf16").ranks[0].memory["activations"]
        for name, kw in (("none", {}), ("selective", dict(act_fn=True)), ("full", dict(recompute=True)))
    }
    assert held["full"] < held["selective"] < held["none"]
    assert held["none"] - held["selective"] == 2 * 4 * 32 * 256 * 4 // 2  # d_ff per token, 4 blocks, bf16
    none, selective = (flops.rank_flops(model, batch, Parallel(act_fn=s)) for s in (False, True))
    assert none == selective


def test_attention_flops_with_unequal_widths_equal_the_flop_counter():
    """MLA's q and k carry d_h + rope_dim per head, v d_h: 2 rows seq^2 h (d_qk + d_h) a forward."""
    rows, heads, seq, qk, v = 2, 4, 16, 12, 8
    q, k = (torch.randn(rows, heads, seq, qk) for _ in range(2))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        F.scaled_dot_product_attention(q, k, torch.randn(rows, heads, seq, v))
    model = Transformer(1, 64, heads, 64, head_size=v, rope_dim=qk - v, kv_rank=16)
    assert flops.attention_forward(model, rows, seq) == counter.get_total_flops()
    assert flops.attention_forward(Transformer(1, 64, heads, 64, head_size=v), rows, seq) != counter.get_total_flops()


def test_the_time_model_knows_the_shape():
    a, sms = Assumptions(), 132
    full = gemm_efficiency(128 * 132, 256, 4096, sms, a)
    assert full == pytest.approx(a.matmul_efficiency)  # whole tiles, whole waves, a deep k
    assert gemm_efficiency(128 * 132 + 1, 256, 4096, sms, a) == pytest.approx(full * 132 / 266, rel=0.01)
    assert gemm_efficiency(128 * 132, 255, 4096, sms, a) == pytest.approx(full * 255 / 256)  # a tile part idle
    assert gemm_efficiency(7, 7, 7, 0, a) == a.matmul_efficiency  # a measured device: no quantisation


def test_causal_attention_costs_half_its_square():
    model, batch, parallel = MODELS["llama3-8b"], Batch(8, 131072, 8), Parallel(ParallelDims(dp=1, tp=8), sp=True)
    cost = step_cost(model, batch, parallel, "bf16", "cuda")
    half, whole = (predict(cost, cluster("h100"), Assumptions(attention_share=s)) for s in (0.5, 1.0))
    attention = 3 * model.layers * flops.attention_forward(model, 8, 131072, 8) / (989.4e12 * 0.5)
    assert whole.compute - half.compute == pytest.approx(attention / 2, rel=1e-9)


def test_the_math_path_keeps_the_softmax_as_the_formula_says():
    """On CUDA, float64 attention runs torch's math path, which keeps the softmax (lesson 08's cause of lesson
    13's CUDA misses). Forced here on the CPU: what autograd saves equals the formula with math=True, and not
    the fused kernel's."""
    n, seq, d, h, ffn = 2, 12, 24, 4, 48
    block = Block(d, h, ffn, BlockOptions(causal=True, fused_qkv=False, sdpa=True), seed=0, dtype=torch.float64)
    x, _ = token_batch(n, seq, d, 1, torch.float64)
    with sdpa_kernel(SDPBackend.MATH), SavedActivations(exclude=[x, *block.parameters()]) as saved:
        out = block(x)
    got = saved.nbytes + out.untyped_storage().nbytes()
    model, batch = Transformer(1, d, h, ffn), Batch(n, seq)
    cfg = BlockConfig(model, n, seq, 0.0, 0, torch.float64)
    assert got == activation_bytes(cfg, 1, False, math=True) != activation_bytes(cfg, 1, False)
    on_cuda = memory.per_rank(model, batch, Parallel(), "float64", 0, "cuda")["activations"]
    assert on_cuda == memory.per_rank(model, batch, Parallel(), "float64", 0, "cpu")[
        "activations"
    ] + 8 * n * h * seq * (seq - 1)


def test_one_shape_type_for_lessons_and_planner():
    dims = ParallelDims.parse_layout("dp=64,tp=8,pp=16")
    assert Parallel(dims, zero="ZeRO-1").dims == dims and dims.size == 8192 and str(dims) == "64x16x8x1"
    assert ParallelDims.parse("2x2x2x1") == ParallelDims(2, 2, 2, 1)
    assert dims.members(0, "tp") == ",".join(map(str, range(8)))
    with pytest.raises(ValueError, match="ep: expert parallelism takes its ranks from dp"):
        ParallelDims(dp=6, ep=4)
    assert PRECISIONS["fp8"].rate == "fp8" and PRECISIONS["fp8"].mfu_peak == "bf16"
    assert GIB == 2**30


def test_one_rank_order_puts_the_same_groups_inside_a_node_for_the_planner_and_lesson_12():
    """dp 2, pp 2, tp 4 on 8-GPU nodes: lesson 12's mesh (built in `LAYOUT`) groups ranks 0 and 4 for dp, 0 and 8
    for pp; the planner prices dp's collectives on NVLink and pp's sends on the network, as those groups sit."""
    # the lesson builds its mesh in the one order (its source read, not loaded: 10+ s of imports)
    source = lesson_path("composed_mesh").read_text()
    assert "from distlab.composed.dims import LAYOUT" in source and "mesh_dim_names=LAYOUT" in source
    shape, where = ParallelDims(dp=2, pp=2, tp=4), cluster("h100", 8)
    for dim in ("dp", "pp", "tp"):
        for rank in range(shape.size):
            nodes = {int(r) // where.gpus_per_node for r in shape.members(rank, dim).split(",")}
            assert (where.link(shape.spans()[dim]) is where.intra) == (len(nodes) == 1), (dim, rank)
    assert shape.members(0, "dp") == "0,4" and shape.members(0, "pp") == "0,8"
    model, batch = MODELS["llama3-8b"], Batch(8, 1024, 4)
    cost = step_cost(model, batch, Parallel(shape, "ZeRO-1", sp=True), "bf16", "cuda")
    links = {dim: cluster("h100", 8).link(span) for dim, span in shape.spans().items()}
    assert links["dp"].name.startswith("NVLink") and links["pp"].name == "400G" and links["tp"].name.startswith("NV")
    inside, across = predict(cost, where).comm, predict(cost, where, links=links | {"dp": where.inter}).comm
    assert inside["dp"] < across["dp"] and inside["pp"] == across["pp"]  # dp's bytes ride NVLink, as the mesh puts them


@pytest.mark.parametrize("grad_bytes, fixed, sharded", [(4, 6, 12), (2, 4, 16)])
def test_zero1_holds_what_megatron_s_distributed_optimizer_holds_item_by_item(grad_bytes, fixed, sharded):
    """Megatron-LM's docs ("Distributed Optimizer"): bytes per parameter 6 + 12/d with bf16 weights and float32
    gradients (2 weights, 4 gradients; 4 master and 8 moments over d), 4 + 16/d with bf16 gradients (their float32
    main gradients a shard beside the buffer). GPT-3 175B on d = 8: every unit divides by 8, so no padding."""
    model, d = MODELS["gpt3-175b"], 8
    psi = model.parameters
    held = memory.per_rank(model, Batch(8, 16), Parallel(ParallelDims(dp=d), "ZeRO-1", grad_bytes=grad_bytes), "bf16")
    main_gradients = 0 if grad_bytes == 4 else 4 * psi // d
    assert held["weights"] == 2 * psi and held["gradients"] == grad_bytes * psi + main_gradients
    assert held["master copy"] == 4 * psi // d and held["moments"] == 8 * psi // d
    states = held["weights"] + held["gradients"] + held["master copy"] + held["moments"]
    assert states == fixed * psi + sharded * psi // d  # the table's row; AdamW's step counts are beside it


def test_the_step_is_its_items_each_printed():
    """Where the time goes: matrix products, attention, elementwise and norms, each dimension's exposed
    communication, the bubble and the optimizer step add up to the predicted step, and --layout prints them."""
    model, batch = MODELS["llama3-8b"], Batch(16, 4096, 4)
    cost = step_cost(model, batch, Parallel(ParallelDims(dp=4, pp=2, tp=2), "ZeRO-1", sp=True), "bf16", "cuda")
    time = predict(cost, cluster("h100"))
    assert sum(time.items.values()) == pytest.approx(time.step, rel=1e-12)
    expected = ["matrix products", "attention", "elementwise and norms", "tp exposed", "dp exposed", "pp exposed"]
    assert set(expected + ["pipeline bubble", "optimizer step"]) <= set(time.items)
    assert all(seconds > 0 for seconds in time.items.values())
    argv = ["--gpus", "16", "--nodes", "2", "--global-batch", "16", "--seq-len", "4096", "--layout", "dp=4,pp=2,tp=2"]
    with console.capture() as captured:
        main(argv)
    assert all(item in captured.get() for item in expected) and "Where the step goes" in captured.get()


def _deepseek(measures=(), schedule="zb-h1") -> tuple[Transformer, Batch, Parallel]:
    """DeepSeek-V3 as its technical report lays it out (https://arxiv.org/abs/2412.19437, section 3.1-3.3): 2,048
    H800, 16-way pipeline, 64-way expert parallelism inside 128-way ZeRO-1 data parallelism, 15,360 sequences of
    4,096 tokens (one a micro-batch here: M = 120), float32 master weights and gradients."""
    dims = ParallelDims(dp=128, pp=16, ep=64)
    parallel = Parallel(dims, "ZeRO-1", schedule=schedule, grad_bytes=4, measures=measures)
    return MODELS["deepseek-v3"], Batch(15360, 4096, 120), parallel


def test_deepseek_v3_s_published_layout_fits_the_h800_with_its_memory_measures():
    """Without the report's memory measures its published layout does not fit the 80 GB H800 by the cost model;
    with them (`distlab.cost.inputs.MEASURES`: sections 3.2.3 and 3.3.3) every rank fits, the 4 GiB reserve in.
    Each measure's saving on rank 0 (the embedding and blocks 0-3: three dense, one a mixture of experts; ZB-H1
    keeps P = 16 micro-batches there, lesson 05) computed here from the model's sizes: bf16 at e = 2 bytes,
    FP8 at 1 + 4/128 (a float32 scale per 1 x 128 tile), E5M6 at 12/8 + 4/128, one micro-batch T = 4,096 tokens."""
    model, batch, parallel = _deepseek()
    where, reserve = cluster("h800"), 4 * GIB
    d, h, T, e, in_flight = model.dim, model.heads, 4096, 2, 16
    fp8, e5m6 = Fraction(33, 32), Fraction(49, 32)

    def held(*measures: str, rank: int = 0) -> dict[str, int]:
        return memory.per_rank(model, batch, replace(parallel, measures=measures), "fp8", rank, "cuda")

    def fullest(*measures: str, schedule: str = "zb-h1") -> int:
        priced = replace(parallel, measures=measures, schedule=schedule, stages_per_rank=1 + (schedule == "dualpipe"))
        return step_cost(model, batch, priced, "fp8", "cuda").peak_held + reserve

    none = held()
    norm_up = e * T * (2 * d + model.q_rank + model.kv_rank + h * (2 * model.qk_dim + model.head_dim))
    assert none["activations"] - held("recompute-norm-up")["activations"] == in_flight * 4 * norm_up
    linear_in = (e - fp8) * T * (2 * d + model.q_rank + model.kv_rank) + (e - e5m6) * T * h * model.head_dim
    dense = linear_in + (e - fp8) * T * model.ffn  # fc2's input in FP8
    routed = (e - fp8) * T * model.top_k * d  # the experts' dispatched inputs in FP8
    swiglu = T * (model.top_k + model.shared_experts) * model.expert_ffn * (2 * (e - fp8) + e)  # 2 in FP8, 1 rebuilt
    assert none["activations"] - held("fp8-activations")["activations"] == in_flight * (
        3 * dense + linear_in + routed + swiglu
    )
    units = [model.units()[i] for i in range(5)]  # the embedding, blocks 0-3
    stepped = sum(-(-sum(w.on_rank(1) for w in u if not w.experts) // 128) for u in units)
    stepped += sum(-(-sum(w.on_rank(1, 64) for w in u if w.experts) // 2) for u in units)  # experts: dp / ep = 2
    assert none["moments"] - held("bf16-moments")["moments"] == 2 * 2 * stepped  # two moments, 4 -> 2 bytes
    before, after = fullest(), fullest(*DEEPSEEK_V3_MEASURES)
    assert before > where.device.memory >= after  # 120.2 GiB, then 52.0, the reserve in: the H800 holds 79.65
    assert fullest("recompute-norm-up") < before and fullest("fp8-activations") < before
    # on its own schedule, DualPipe (two copies of the parameters, P + 1 chunks in flight): 70.8 GiB
    assert fullest(schedule="dualpipe") > where.device.memory >= fullest(*DEEPSEEK_V3_MEASURES, schedule="dualpipe")


def test_dualpipe_and_dualpipev_are_priced_as_lesson_19_s_grids():
    """Lesson 19's grids, simulated from its orders (an independent count: the planner prices closed forms):
    the planner's bubble and in-flight micro-batches equal the grids' on every rank, for DualPipeV (a V of 2P
    half stages) and DualPipe (two copies of P whole chunks). DualPipe holds chunk r and chunk P - 1 - r of a P-way
    cut on rank r (the embedding and the head on ranks 0 and P - 1), twice DualPipeV's parameters over the ranks,
    and runs each micro-batch through one of the two: every rank's FLOPs add up to the model's, not twice."""
    lesson = load_lesson("dualpipe")
    model = Transformer(16, 32, 4, 64, 96)
    orders = {"dualpipev": lesson.dualpipev, "dualpipe": lesson.dualpipe}
    for pp, m in ((4, 8), (8, 16)):
        batch = Batch(m, 16, m)
        grids = {
            "dualpipev": simulate(lesson.flatten(lesson.dualpipev(pp, m))),
            "dualpipe": lesson.dualpipe_timing(pp, m),
        }
        for name, timing in grids.items():
            parallel = Parallel(ParallelDims(pp=pp), schedule=name, stages_per_rank=2)
            assert schedule.grid(parallel, batch)[1] == pytest.approx(timing.bubble_fraction(), rel=1e-12)
            held = peak_in_flight(lesson.flatten(orders[name](pp, m)))
            assert [schedule.in_flight(parallel, batch, r) for r in range(pp)] == held
            cost = step_cost(model, batch, parallel, "float32")
            assert sum(r.flops.model for r in cost.ranks) == cost.model_flops  # every micro-batch through once
    batch, chunks = Batch(8, 16, 8), [model.units()[1 + 4 * k : 5 + 4 * k] for k in range(4)]  # a 4-way cut
    weights = {
        name: [
            memory.per_rank(model, batch, Parallel(ParallelDims(pp=4), schedule=name, stages_per_rank=2), "float32", r)[
                "weights"
            ]
            for r in range(4)
        ]
        for name in orders
    }
    ends = sum(w.numel for w in (model.embedding(), *model.head_weights()))
    for r in range(4):
        blocks = sum(w.numel for chunk in (chunks[r], chunks[3 - r]) for unit in chunk for w in unit)
        assert weights["dualpipe"][r] == 4 * (blocks + (ends if r in (0, 3) else 0))
    assert sum(weights["dualpipev"]) == 4 * model.parameters  # one copy over the ranks; DualPipe two
    assert sum(weights["dualpipe"]) == 2 * sum(weights["dualpipev"])
