"""One transformer size record (`distlab.proof.sizes.Transformer`) describes the models the lessons build, and
one validation (`ParallelDims.check`) says which shapes can run them.

Lesson 08's block (`BlockConfig.model`, one layer) and lesson 12's language model (`RunConfig.model`) are built
from the record's sizes; the cost model and lesson 12's closed forms read the record's `Weight`s instead of
listing the parameters again. So the record's weights must be, name for name and shape for shape, what torch
builds: checked here against the modules themselves (`named_parameters`), each check shown able to fail on a
record that differs in one option.
"""

from dataclasses import replace
from itertools import product

import pytest
import torch

from distlab.composed.config import RunConfig, check_shape
from distlab.composed.cost import stage_units
from distlab.composed.dims import ParallelDims
from distlab.composed.model import LanguageModel, keep_stage
from distlab.cost import rules
from distlab.cost.inputs import Batch, Parallel
from distlab.layer_split.tensor_parallel.model import BlockConfig, build
from distlab.plan.search import layouts
from distlab.proof.sizes import Transformer, Weight


def shapes(weights: list[Weight], prefix: str = "") -> dict[str, tuple[int, ...]]:
    """{name: torch's shape} of the record's weights (a vector has one column: shape (rows,))."""
    return {prefix + w.name: (w.rows,) if w.cols == 1 else (w.rows, w.cols) for w in weights}


def built(module: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    return {name: tuple(p.shape) for name, p in module.named_parameters()}


def record_of(model: Transformer) -> dict[str, tuple[int, ...]]:
    """The whole model's parameters by the record: the embedding, every block under layers.i., norm and head."""
    out = shapes([model.embedding()]) if model.vocab else {}
    for i in range(model.layers):
        out |= shapes(model.layer_weights(i), f"layers.{i}.")
    return out | (shapes(model.head_weights()) if model.vocab else {})


def test_lesson08s_block_is_its_record():
    cfg = BlockConfig()
    block, _, _ = build(cfg)
    assert built(block) == shapes(cfg.model.block_weights())
    assert sum(p.numel() for p in block.parameters()) == cfg.model.parameters
    wrong = replace(cfg.model, key_bias=False)  # a record that forgets k's bias
    assert built(block) != shapes(wrong.block_weights())


def test_lesson12s_model_is_its_record():
    cfg = RunConfig()
    model = LanguageModel(cfg)
    assert built(model) == record_of(cfg.model)
    assert sum(p.numel() for p in model.parameters()) == cfg.model.parameters
    with_key_bias = replace(cfg.model, key_bias=True)  # the record lesson 12 does not build
    assert built(model) != record_of(with_key_bias)


def test_the_key_bias_option_builds_what_it_says():
    cfg = RunConfig(replace(RunConfig().model, key_bias=True))
    assert built(LanguageModel(cfg)) == record_of(cfg.model)


@pytest.mark.parametrize("pp", [1, 2])
def test_lesson12s_stages_hold_the_records_units(pp):
    """At tp = 1 a stage's FSDP2 units (the closed forms' `stage_units`) are exactly its module's parameters."""
    cfg = RunConfig()
    for stage in range(pp):
        kept = keep_stage(LanguageModel(cfg), stage, pp)
        counted = sorted(shape if len(shape) == 2 else (*shape, 1) for shape in built(kept).values())
        units = stage_units(cfg, ParallelDims(pp=pp), stage)
        assert sorted(piece for unit in units for piece in unit) == counted
        wrong = stage_units(RunConfig(replace(cfg.model, key_bias=True)), ParallelDims(pp=pp), stage)
        assert sorted(piece for unit in wrong for piece in unit) != counted


def test_a_block_config_is_one_block():
    with pytest.raises(ValueError, match="one layer"):
        BlockConfig(Transformer(layers=2, dim=24, heads=12, ffn=48))
    assert BlockConfig(Transformer(layers=3, dim=24, heads=12, ffn=48, vocab=8).one_block()).model.layers == 1


def _refusal(check, *args) -> str | None:
    try:
        check(*args)
    except ValueError as err:
        return str(err)
    return None


def test_lesson12_the_cost_model_and_the_planner_refuse_a_shape_for_one_reason():
    """`ParallelDims.check` is the one validation of a shape: on lesson 12's run, every shape of degrees 1-4 it
    refuses, the cost model refuses in the same words, lesson 12 under the blamed word's flag, and the planner's
    search never tries; every shape it lets run, the planner tries when its own choices allow (powers of two,
    tp inside a node of 8, no cp below `MIN_CP_TOKENS` tokens a rank)."""
    cfg = RunConfig()
    batch = Batch(cfg.batch, cfg.seq, cfg.micro_batches)
    refused, searched = 0, {}
    for degrees in product((1, 2, 3, 4), repeat=4):
        dims = ParallelDims(*degrees)
        why = _refusal(dims.check, cfg.model, cfg.batch, cfg.seq, cfg.micro_batches)
        priced = _refusal(rules.check, cfg.model, batch, Parallel(dims, sp=dims.tp > 1), "float64")
        flagged = _refusal(check_shape, cfg, dims, dims.size)
        if dims.size not in searched:
            searched[dims.size] = set(layouts(cfg.model, Batch(cfg.batch, cfg.seq), dims.size, 8))
        tried = dims in searched[dims.size]
        if why is None:
            powers = all(d & (d - 1) == 0 for d in degrees[2:])
            assert tried == (powers and dims.tp <= 8 and dims.cp == 1), dims
            continue
        refused += 1
        blamed, _, message = why.partition(": ")
        assert priced == why and flagged == f"--{blamed.replace('_', '-')}: {message}" and not tried, dims
    assert 0 < refused < 4**4
