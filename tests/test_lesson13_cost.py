"""Lesson 13: a step's FLOPs, bytes held and bytes sent, predicted by `distlab.cost` from sizes alone, equal
what four configurations of a block stack (DDP, DDP recomputing every block, TP, TP + SP) count on real
ranks; the lesson runs under torchrun at 80 columns and records its calibration, its predicted and measured
times and its MFU in --json (the time is a figure, never a claim: it lives on a shared machine). The
comparison can fail: the measured bytes of a sequence-parallel step are not what plain tensor parallelism
sends. Part 1 calibrates a link over a subgroup on every rank, the one outside it too. Bad flags are refused in
one line."""

import json
from argparse import Namespace

import pytest
from helpers import assert_flag_refused, assert_lesson_passes_at_80_columns, load_lesson

from distlab.composed.dims import ParallelDims
from distlab.cost import memory, traffic
from distlab.cost.inputs import Batch, Parallel
from distlab.cost.trial import Stack, Trial
from distlab.processes.spawn import spawn
from distlab.proof.sizes import Transformer

LESSON = "13_cost.py"
SMALL = ("--layers", "2", "--repeats", "2")  # the lesson's claims at its sizes, a shorter timing


def test_the_lesson_passes_at_80_columns_and_records_its_figures(tmp_path):
    path = tmp_path / "cost.json"
    out = assert_lesson_passes_at_80_columns(LESSON, 2, *SMALL, "--json", str(path))
    assert "Measured / predicted:" in out and "2:4-sparse headline" in out
    report = json.loads(path.read_text())
    figures = report["figures"]
    assert report["passed"] and set(figures["time"]) == {"DDP", "DDP + recompute", "TP", "TP + SP"}
    for config in figures["time"].values():
        assert 0 < config["predicted"] < config["with_ops"] and config["measured"] > 0
    assert figures["mfu"]["DDP + recompute"]["hfu"] > figures["mfu"]["DDP + recompute"]["mfu"]
    published = figures["mfu"]["published"]  # the 2:4-sparse headline is twice the dense peak
    assert published["mfu_sparse_peak"] == pytest.approx(published["mfu"] / 2, rel=1e-3)
    assert len(figures["roofline"]["points"]) == 10 and figures["calibration"]["rates"]["float32"] > 0


def _sequence_parallel_bytes(rt):
    """A sequence-parallel step of the lesson's Trial (`distlab.cost.trial`): the bytes it sent per collective."""
    lesson = load_lesson("13_cost")
    stack = Stack(Transformer(2, 96, 12, 384), Batch(12, 48), lr=1e-3, seed=0)
    trial = Trial(rt, stack, Parallel(ParallelDims(tp=rt.world_size), sp=True), lesson.OPTIONS)
    return dict(trial.measured(0.0).sent)


def test_the_bytes_check_can_fail():
    """The lesson's claim compares per collective: plain TP's prediction does not match an SP step."""
    got = spawn(_sequence_parallel_bytes, 2)[0]
    model, batch = Transformer(2, 96, 12, 384), Batch(12, 48)
    predicted = {
        sp: {
            k: n
            for (_, k), n in traffic.per_rank(model, batch, Parallel(ParallelDims(tp=2), sp=sp), "float32").sent.items()
        }
        for sp in (True, False)
    }
    assert got == predicted[True] and got != predicted[False]


@pytest.mark.parametrize("flag,value", [("--layers", "0"), ("--dim", "-4"), ("--repeats", "x")])
def test_bad_flags_are_refused_in_one_line(flag, value):
    assert_flag_refused(LESSON, flag, flag, value)


@pytest.mark.parametrize(
    "changes,flag",
    [(dict(heads=5), "--heads"), (dict(global_batch=9), "--global-batch"), (dict(seq_len=47), "--seq-len")],
)
def test_the_world_rules_name_the_flag(changes, flag):
    args = Namespace(**(dict(layers=4, dim=96, heads=12, ffn_width=384, seq_len=48, global_batch=12) | changes))
    with pytest.raises(ValueError, match=flag):
        load_lesson(LESSON).world_rules(args, 2)


def _links_over_a_subgroup(rt):
    """Part 1's calibration of a link over ranks 0 .. 1 of 3: the rank outside the group calls it too."""
    from distlab.cost import calibrate

    return [calibrate.link(rt, 2, kind, by_hand, 1) for kind, by_hand in (("all_reduce", True), ("all_gather", False))]


def test_a_link_is_calibrated_over_a_subgroup_on_every_rank():
    """At P = 3 the lesson calibrates P = 2 as well: every rank returns the same named links (the slowest
    rank's times), the one outside the group included."""
    links = spawn(_links_over_a_subgroup, 3)
    assert [[link.name for link in rank] for rank in links] == [
        ["ring by hand all_reduce, P = 2", "gloo all_gather, P = 2"]
    ] * 3
    assert all(link.bandwidth > 0 and link.latency >= 0 for rank in links for link in rank)
    assert links[0] == links[1] == links[2]


def test_the_time_factor_ranks_only_beyond_it_and_the_roof_needs_a_reason():
    """Two configurations inside the stated factor are not ranked; a kernel above the roof with a working set
    beyond the caches is marked ABOVE (the lesson's verdict fails on it), one in cache is named so."""
    lesson = load_lesson("13_cost")
    factor = lesson.TIME_FACTOR
    pairs = lesson.ranked({"a": 1.0, "b": factor / 2, "c": factor * factor})
    assert [(a, b, may) for a, b, _, may in pairs] == [("a", "b", False), ("b", "c", True)]
    peak, bandwidth = 1e11, 1e10
    assert lesson.roof_note("add 2^25", 1 / 12, 1e10, peak, bandwidth).startswith("ABOVE")
    assert lesson.roof_note("add 2^20", 1 / 12, 1e10, peak, bandwidth) == "above: 12 MiB working set, in cache"
    assert lesson.roof_note("add 2^25", 1 / 12, 1e8, peak, bandwidth) == "under"


def test_the_lessons_arithmetic_knows_the_math_path():
    """On CUDA in float64 attention keeps its softmax: the lesson's count by hand and distlab.cost's agree."""
    lesson = load_lesson("13_cost")
    model, batch, parallel = Transformer(2, 96, 12, 384), Batch(12, 48), Parallel(ParallelDims(tp=2), sp=True)
    for math in (False, True):
        kept = memory.stage_activations(model, batch, parallel, 0, memory.PRECISIONS["float64"], 8, math)
        assert lesson.rank_bytes(model, batch, parallel, 8, math)["activations"] == kept
    assert lesson.rank_bytes(model, batch, parallel, 8, True) != lesson.rank_bytes(model, batch, parallel, 8)


def test_cuda_float32_attention_keeps_a_padded_log_sum_exp():
    """On CUDA the float32 blocks run the memory-efficient attention, which keeps its log-sum-exp padded to 32
    queries and its dropout seed and offset (read from PyTorch's source; `efficient_attention_extra`): at the
    lesson's 12 sequences x 12 heads x 48 tokens, 4 x 12 x 12 x 16 + 16 = 9,232 bytes a block beyond the formula;
    h / tp heads under TP; nothing on a CPU or when blocks recompute. A rule that forgets the padding is short."""
    from distlab.layer_split.tensor_parallel.cost import efficient_attention_extra

    lesson = load_lesson("13_cost")
    model, batch = Transformer(4, 96, 12, 384), Batch(12, 48)
    assert efficient_attention_extra(12, 12, 48) == 9232 and efficient_attention_extra(12, 12, 64) == 16
    assert lesson.cuda_attention_extra("cuda", model, batch, Parallel()) == 4 * 9232
    assert lesson.cuda_attention_extra("cuda", model, batch, Parallel(ParallelDims(tp=2), sp=True)) == 4 * (
        4 * 12 * 6 * 16 + 16
    )
    assert lesson.cuda_attention_extra("cuda", model, batch, Parallel(recompute=True)) == 0
    assert lesson.cuda_attention_extra("cpu", model, batch, Parallel()) == 0
    unpadded = 4 * (4 * 12 * 12 * 0 + 16)  # the twin without the padding
    assert lesson.cuda_attention_extra("cuda", model, batch, Parallel()) != unpadded
