"""Lesson 08: the conjugate operators f, g, f-bar, g-bar (the lesson's, and the library's twins) equal one
process's computation forward and backward, and each other bit for bit; the MLP and attention split by
heads with the lesson's layers, and the whole block under tensor and sequence parallelism (dropout masks
replayed), equal the unsplit layer in float64 (output, every gradient, 3 SGD steps), and the library's
layers and operators train the same block bit for bit; the bytes each rank sends and the activations it
keeps equal their formulas; torch's parallelize_module equals ours; one dp x tp step on a DeviceMesh equals
one process on the whole batch. Bad splits are refused the same way on every rank, before any collective."""

from dataclasses import replace
from fractions import Fraction

import pytest
import torch
from helpers import (
    assert_flag_refused,
    assert_lesson_passes_at_80_columns,
    load_lesson,
)
from torch.nn.attention import SDPBackend, sdpa_kernel

from distlab.comm.ledger import Ledger
from distlab.layer_split.tensor_parallel import cost, mesh2d, operators, torch_tp
from distlab.layer_split.tensor_parallel.blocks import check_split
from distlab.layer_split.tensor_parallel.layers import reference_shards
from distlab.layer_split.tensor_parallel.model import BlockConfig
from distlab.layer_split.tensor_parallel.operator_checks import check_operator
from distlab.layer_split.tensor_parallel.runs import activation_bytes_measured, reference, same_runs, split_run
from distlab.processes.spawn import spawn
from distlab.proof.compare import against, all_ok, compare
from distlab.proof.sizes import Transformer

# Small, and split by 1, 2, 3 and 4: h = 12 heads of width 2, d_ff = 24, seq = 12.
CFG = BlockConfig(Transformer(layers=1, dim=24, heads=12, ffn=24), batch=6, seq=12, dropout=0.2, seed=3)
STEPS, LR = 3, 0.5


def _everything(rt):
    """Every claim of the lesson on one rank, with the lesson's own layers and operators: name -> bool."""
    lesson, P = load_lesson("tensor_parallel"), rt.world_size
    ok = {}
    for k, (mine, library) in lesson.OPERATORS.items():
        ours, theirs = check_operator(rt, k, mine), check_operator(rt, k, library)
        ok[f"operator {k} = one process"] = ours.ok
        ok[f"library {k} = one process"] = theirs.ok
        ok[f"library {k} = lesson's"] = torch.equal(ours.forward, theirs.forward) and torch.equal(
            ours.backward, theirs.backward
        )
    for part in ("mlp", "attention"):
        o = split_run(rt, CFG, part, lesson.by_hand(), STEPS, LR, lesson.LAYERS)
        ok[f"{part} = unsplit"] = o.ok
        ok[f"{part} bytes"] = _sent(o.ledger) == _nonzero(cost.expected_traffic(CFG, part, P, False, STEPS))
    for sp, library in ((False, operators.tensor_parallel), (True, operators.sequence_parallel)):
        o = split_run(rt, CFG, "block", lesson.by_hand(sequence_parallel=sp), STEPS, LR, lesson.LAYERS)
        ok[f"block sp={sp} = unsplit"] = o.ok
        ok[f"block sp={sp} bytes"] = _sent(o.ledger) == _nonzero(cost.expected_traffic(CFG, "block", P, sp, STEPS))
        twin = split_run(rt, CFG, "block", library(), STEPS, LR)  # the library's layers and operators
        ok[f"block sp={sp} library = lesson's"] = (
            all_ok(against(o.run, twin.run, 0.0, 0.0).values()) and o.ledger.sent_by == twin.ledger.sent_by
        )
        held = activation_bytes_measured(rt, CFG, lesson.by_hand(sequence_parallel=sp), lesson.LAYERS)[0]
        ok[f"block sp={sp} activations"] = held == cost.activation_bytes(CFG, P, sp)
        with sdpa_kernel(SDPBackend.MATH):  # the path float64 takes on CUDA: the softmax kept, N h seq^2
            held = activation_bytes_measured(rt, CFG, lesson.by_hand(sequence_parallel=sp), lesson.LAYERS)[0]
        ok[f"block sp={sp} activations, math attention"] = held == cost.activation_bytes(CFG, P, sp, math=True)
        off = replace(CFG, dropout=0.0)
        ours = split_run(rt, off, "block", lesson.by_hand(sequence_parallel=sp), STEPS, LR, lesson.LAYERS)
        ok[f"parallelize_module sp={sp} = ours"] = ours.ok and same_runs(
            ours.run, torch_tp.torch_run(rt, off, sp, STEPS, LR)[0]
        )
    run, model, where = mesh2d.two_d_step(rt, CFG, LR)
    ref = reference(CFG, "block", 1, LR)
    ref.first_grads.pop("input")
    ok["2-D grads"] = all_ok(
        compare(reference_shards(ref.first_grads, model, where["i_tp"], where["tp"]), run.first_grads)
    )
    ok["2-D params"] = all_ok(compare(reference_shards(ref.params, model, where["i_tp"], where["tp"]), run.params))
    shard = sum(q.numel() for q in model.parameters())
    ok["2-D bytes"] = _sent(model.attn.comm.ledger) == _nonzero(mesh2d.expected_2d_traffic(CFG, P, shard))
    return ok


def _sent(ledger):
    return _nonzero(ledger.sent_by)


def _nonzero(bytes_by_key):
    return {k: v for k, v in bytes_by_key.items() if v}


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_every_claim(world_size):
    for rank, ok in enumerate(spawn(_everything, world_size)):
        failed = [name for name, good in ok.items() if not good]
        assert not failed, (rank, failed)
        assert len(ok) == 31


def _torch_tp_with_cudas_optimizer_default(rt, sequence_parallel: bool):
    """torch's TP run with SGD defaulting to the foreach kernels, as it does on CUDA (CPU: one tensor each)."""
    import importlib

    sgd = importlib.import_module("torch.optim.sgd")  # (torch.optim does not keep the name)
    sgd._default_to_fused_or_foreach = lambda *args, **kwargs: (False, True)
    run, _, _ = torch_tp.torch_run(rt, replace(CFG, dropout=0.0), sequence_parallel, STEPS, LR)
    return len(run.losses)


def test_torchs_tensor_parallel_steps_with_sgds_cuda_default():
    """Without sequence parallelism the LayerNorms stay plain tensors beside the DTensors (at any P, 1 too);
    SGD's foreach kernels refuse that mix, so the lesson's SGD steps one tensor at a time, on every device."""
    assert spawn(_torch_tp_with_cudas_optimizer_default, 1, False) == [STEPS]


def test_lesson_passes_at_p4_on_a_2x2_mesh():
    out = assert_lesson_passes_at_80_columns("tensor_parallel", 4)
    assert "a 2 x 2 mesh (dp x tp)" in out and "data-parallel group [0, 2]" in out


def test_the_formulas_in_closed_form():
    # Tensor parallel: 2(P-1)/P N seq d e each way per MLP; sequence parallel: the same, halves of it.
    a_bytes = CFG.batch * CFG.seq * CFG.model.dim * 8
    tp = cost.expected_traffic(CFG, "mlp", 4, False)
    sp = cost.expected_traffic(CFG, "block", 4, True)
    assert tp[("forward", "all_reduce")] == Fraction(3, 2) * a_bytes
    assert sp[("forward", "all_gather")] + sp[("forward", "reduce_scatter")] == 2 * Fraction(3, 2) * a_bytes
    assert sp[("gradients", "all_reduce")] == Fraction(3, 2) * 6 * CFG.model.dim * 8
    assert all(v == 0 for v in cost.expected_traffic(CFG, "block", 1, True).values())
    # Activations: P = 1 is the unsplit block either way; sequence parallelism saves (P-1)/P S.
    region = cost.activation_terms(CFG)[0]
    assert cost.activation_bytes(CFG, 1, True) == cost.activation_bytes(CFG, 1, False)
    assert cost.activation_bytes(CFG, 4, False) - cost.activation_bytes(CFG, 4, True) == Fraction(3, 4) * region * 8
    # Which attention runs: float64 on CUDA has no fused kernel (the math path); the CPU's and CUDA's bf16 do.
    assert cost.sdpa_math_path("cuda", torch.float64)
    assert not cost.sdpa_math_path("cpu", torch.float64) and not cost.sdpa_math_path("cuda", torch.bfloat16)


def _g_without_reduce(rt):
    """A g that forgets its all-reduce: the check must catch it."""

    class Broken(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group, ledger):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            return grad, None, None

    comm = operators.Comm(operators.CopyToTP, Broken, None, Ledger())
    broken, library = check_operator(rt, "g", Broken), check_operator(rt, "g", operators.ReduceFromTP)
    return split_run(rt, CFG, "mlp", comm, 1, LR).ok, broken.ok, torch.equal(broken.forward, library.forward)


def _bias_on_every_rank(rt):
    """A row-parallel layer that adds its bias to each partial sum (P times in all): the run is no longer the
    unsplit MLP's, nor the library's twin's, bit for bit."""
    from distlab.layer_split.tensor_parallel.layers import Layers, RowParallelLinear

    class BiasEverywhere(RowParallelLinear):
        def forward(self, x):
            return torch.nn.functional.linear(x, self.weight, self.bias)

    lesson = load_lesson("tensor_parallel")
    wrong = split_run(rt, CFG, "mlp", lesson.by_hand(), 1, LR, Layers(lesson.ColumnParallelLinear, BiasEverywhere))
    twin = split_run(rt, CFG, "mlp", operators.tensor_parallel(), 1, LR)
    return wrong.ok, all_ok(against(wrong.run, twin.run, 0.0, 0.0).values())


def test_the_checks_can_fail():
    assert spawn(_g_without_reduce, 2) == [(False, False, False)] * 2
    assert spawn(_bias_on_every_rank, 2) == [(False, False)] * 2


def _refusals(rt):
    from helpers import value_error

    return [
        value_error(check_split, 6, 24, rt.world_size),
        value_error(check_split, 12, 18, rt.world_size),
        value_error(check_split, 12, 24, rt.world_size, 10),
        value_error(mesh2d.check_mesh, replace(CFG, batch=5), rt.world_size),
    ]


def test_bad_splits_are_one_line_naming_the_flag_on_every_rank():
    per_rank = spawn(_refusals, 4)
    assert all(messages == per_rank[0] for messages in per_rank)
    for flag, message in zip(("--heads", "--ffn-width", "--seq-len", "--global-batch"), per_rank[0]):
        assert message.startswith(flag + ":") and "\n" not in message, message
    assert_flag_refused("tensor_parallel", "--heads", "--heads", "0")
    assert_flag_refused("tensor_parallel", "--dropout", "--dropout", "1")
