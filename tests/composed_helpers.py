"""Lesson 12's tests' shared parts: the lesson's model trained at a list of mesh shapes on this rank, against
one process (`lesson.reference`: a fresh whole model, plain autograd, torch's AdamW), and what every test
asserts of that; the smaller model's flags the torchrun tests pass."""

from __future__ import annotations

from helpers import load_lesson

from distlab.composed import cost
from distlab.composed.config import RunConfig
from distlab.composed.dims import ParallelDims
from distlab.proof.compare import all_ok

LESSON = "12_composed_mesh"
CFG = RunConfig()  # the lesson's defaults: V = 32, d = 32, h = 4, d_ff = 64, L = 4, seq = 16, N = 8, M = 2


def shapes_against_one_process(rt, shapes: list[ParallelDims], cfg: RunConfig) -> list[dict]:
    """Each shape trained on this rank's part of the mesh, against one process: what the test asserts."""
    lesson = load_lesson(LESSON)
    ref = lesson.reference(cfg)
    out = []
    for shape in shapes:
        one = lesson.train_shape(rt, cfg, shape)
        found = lesson.against(ref, one.run)
        place = lesson.place_of(one.mesh_step)
        out.append(
            {
                "loss": max(abs(a - b) for a, b in zip(one.run.losses, ref.losses)),
                "equal": {k: all_ok(v) and len(v) > 0 for k, v in found.items()},
                "names": sorted(one.run.params),
                "sent": one.measured.sent == cost.expected_sent(cfg, shape, place),
                "states": one.states == cost.expected_states(cfg, shape, place),
                "activations": one.measured.activations == cost.expected_activations(cfg, shape, place.stage),
            }
        )
    return out


def assert_every_shape_equals_one_process(per_rank: list[list[dict]], shapes: list[ParallelDims], cfg: RunConfig):
    whole = set(load_lesson(LESSON).LanguageModel(cfg).state_dict())
    for i, shape in enumerate(shapes):
        ranks = [results[i] for results in per_rank]
        for rank, r in enumerate(ranks):
            assert r["loss"] < 1e-10 and all(r["equal"].values()), (shape, rank, r)
            assert r["sent"] and r["states"] and r["activations"], (shape, rank, r)
        assert set().union(*(r["names"] for r in ranks)) == whole, shape  # every parameter held somewhere


SMALL_FLAGS = ("--layers", "2", "--steps", "2")  # the torchrun tests' smaller model (L = 2, two steps)
