"""The library is built in floors of named rooms, and its imports say so: every import points down.

`ls src/distlab` shows the architecture: packages only, no loose module, each one named here. The ground floor
has four rooms, bottom first, each importing only the rooms before it: `processes` (torchrun's environment, who
a process is, the process group, devices, flags, what a rank prints), `pieces` (a batch computed in pieces
exactly as the whole), `comm` (the collectives, the exchange, the ledger, agreeing across ranks) and `proof` (the
models a check trains, the training loop, the reference, the comparison, the measurements, the verdict, the
lessons' command line). On it stand the sibling packages, one per part of the README's arc or per step
(model_split, data_parallel, sharding, tensor_parallel, context_parallel, expert_parallel, resilience,
contrastive, streamed): each imports the ground floor and itself, never a sibling, so each can be read, changed
and tested on its own. The ground floor imports no sibling. On top stand the packages that read every
parallelism at once (`distlab.cost`: a step's cost from each lesson's formula; `distlab.plan`, the planner on
it; `distlab.composed`, lesson 12's dp x pp x tp x cp mesh, whose shape is the cost model's `ParallelDims` and
whose closed forms import lessons 08 and 09's instead of deriving them again): they may import any floor below
and each other, and nothing below imports them. And data flows one way: lessons, tests and benchmarks import
`distlab`, `distlab` never imports a lesson, a test or the lessons' command line (`distlab.proof.cli`). A lesson
imports its own part's rooms and the floors below it in the arc (the ground floor, the parts it builds on),
never a later part's.

Each rule is checked on the source (every import statement, also inside functions, relative ones resolved), and
each check is shown to fail on a planted import. No import circle of any size exists anywhere in the library,
deferred imports included (an import inside a function that closes a circle is still the circle: the streamed
step's launch warning once closed one of nine modules that way), and no import inside a function exists to
dodge one (tests/test_import_rules.py: each deferred import of a distlab module listed with the heavy
dependency it postpones; the lessons' imports down the arc; no argparse namespace in the library).
"""

import ast
from pathlib import Path

import pytest
from layering_helpers import (
    DISTLAB,
    FLOORED,
    GROUND_PACKAGES,
    LIBRARY,
    PARTS,
    ROOMS,
    SIBLINGS,
    TOP_PACKAGES,
    circles,
    import_graph,
    imported_modules,
    imports,
    library_sources,
    module_name,
    room_of,
)

PACKAGES = sorted(p.name for p in DISTLAB.iterdir() if (p / "__init__.py").is_file())
LESSONS_PARSER = "distlab.proof.cli"  # the lessons' command line: lessons, tests and benchmarks only
OUTSIDE = ("lessons", "tests", "helpers", "nbhelpers", "exercise_kit")  # what the library never imports


def floor_breaks(source: str, module: str, is_package: bool = False) -> list[str]:
    """The imports of `module` that cross a floor: any sibling from the ground floor, another sibling from
    a sibling, the top floor from anything below it. The top floor itself may import every floor."""
    own = room_of(module)
    if own in TOP_PACKAGES:
        return []
    breaks = []
    for name in imports(source, module, is_package):
        target = room_of(name)
        if (target in SIBLINGS and target != own) or target in TOP_PACKAGES or ground_upwards(own, target):
            breaks.append(f"{module} imports {name}")
    return sorted(set(breaks))


def ground_upwards(own: str | None, target: str | None) -> bool:
    """A ground-floor room importing one above it on the ground floor (`processes` importing `proof`)."""
    return (
        own in GROUND_PACKAGES
        and target in GROUND_PACKAGES
        and GROUND_PACKAGES.index(target) > GROUND_PACKAGES.index(own)
    )


def outside_imports(source: str, module: str) -> list[str]:
    """The imports of `module` that reach a lesson, a test or a test helper."""
    return sorted(
        {
            f"{module} imports {name}"
            for name in imports(source, module)
            if name.split(".")[0] in OUTSIDE or name.split(".")[0].startswith("test_")
        }
    )


def entries(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name not in ("__init__.py", "__pycache__"))


def test_the_floors_are_what_the_tree_holds():
    """Every entry of src/distlab is a room named here, or a part of the arc holding only its rooms; a new package
    names its floor. `ls src/distlab` shows at most 13 entries besides __init__.py."""
    assert len(set(ROOMS + PARTS)) == len(ROOMS + PARTS)
    top = {room.split(".")[0] for room in ROOMS}
    assert entries(DISTLAB) == PACKAGES == sorted(top), set(entries(DISTLAB)) ^ top
    for part in PARTS:
        assert [f"{part}.{name}" for name in entries(DISTLAB / part)] == sorted(r for r in ROOMS if r.startswith(part))
    assert len(entries(DISTLAB)) <= 13 and len(FLOORED) > 50


def test_every_room_says_what_lives_there():
    for room in ROOMS + PARTS:
        doc = ast.get_docstring(ast.parse((DISTLAB / room.replace(".", "/") / "__init__.py").read_text()))
        assert doc and len(doc.split()) >= 12, room


def test_a_room_is_found_at_its_depth():
    assert room_of("distlab.layer_split.tensor_parallel.cost") == "layer_split.tensor_parallel"
    assert room_of("distlab.proof.compare.compare") == "proof" and room_of("distlab.layer_split") is None
    assert room_of("torch.distributed") is None and room_of("distlab") is None


def lessons_parser_imports(source: str, module: str, is_package: bool = False) -> list[str]:
    """The imports of `module` that reach the lessons' parser (the library keeps its own flags apart)."""
    return sorted(
        {
            f"{module} imports {name}"
            for name in imports(source, module, is_package)
            if name == LESSONS_PARSER or name.startswith(LESSONS_PARSER + ".")
        }
    )


def test_the_library_never_imports_the_lessons_parser():
    offenders = [
        b
        for path in LIBRARY
        if module_name(path) != LESSONS_PARSER
        for b in lessons_parser_imports(path.read_text(), module_name(path), path.name == "__init__.py")
    ]
    assert not offenders, offenders


@pytest.mark.parametrize(
    "planted",
    [
        "from distlab.proof.cli import LessonParser",
        "from distlab.proof import cli",
        "import distlab.proof.cli",
    ],
)
def test_the_parser_check_fails_on_a_planted_import(planted):
    assert lessons_parser_imports(planted, "distlab.plan.cli")
    assert not lessons_parser_imports("from distlab.processes.flags import FlagParser", "distlab.plan.cli")


def test_sibling_packages_import_only_the_ground_floor():
    breaks = [
        b for path in FLOORED for b in floor_breaks(path.read_text(), module_name(path), path.name == "__init__.py")
    ]
    assert not breaks, breaks


def test_the_library_never_imports_a_lesson_or_a_test():
    offenders = [b for path in LIBRARY for b in outside_imports(path.read_text(), module_name(path))]
    assert not offenders, offenders


@pytest.mark.parametrize(
    "module,planted",
    [
        ("distlab.streamed.step", "from distlab.contrastive.rand_context import RandContext"),
        ("distlab.data_split.sharding.zero", "from distlab.data_split import data_parallel"),
        ("distlab.layer_split.tensor_parallel.cost", "def f():\n    import distlab.data_split.sharding.accounting\n"),
        ("distlab.contrastive.cost", "from ..model_split import p2p"),
        ("distlab.comm.ring", "from distlab.data_split.data_parallel.ring import Ring"),  # the ground floor, upwards
        ("distlab.processes.runtime", "from distlab.streamed.safeguards.peers import naming_dead_peers"),
        (
            "distlab.data_split.sharding.accounting",
            "from distlab.cost.memory import model_states",
        ),  # the top floor, from below
        ("distlab.proof.models", "import distlab.plan"),
        (
            "distlab.layer_split.tensor_parallel.cost",
            "from distlab.composed.config import RunConfig",
        ),  # the top floor, from a sibling
    ],
)
def test_the_floor_check_fails_on_a_planted_import(module, planted):
    allowed = "from distlab.processes.runtime import distributed\n"  # the bottom room: below every other
    if room_of(module) not in GROUND_PACKAGES:
        allowed += "from distlab.proof.compare import compare\nfrom distlab.comm.ledger import Ledger\n"
    assert floor_breaks(allowed + planted, module)
    assert not floor_breaks(allowed, module)


@pytest.mark.parametrize(
    "module,planted",
    [
        ("distlab.processes.runtime", "def f():\n    from distlab.proof.verdict import Verdict\n"),
        ("distlab.processes.flags", "from distlab.proof.compare import DTYPES"),  # the lessons' parser, as it was
        ("distlab.comm.collectives", "from distlab.proof.verdict import Verdict"),
        ("distlab.pieces.chunks", "from distlab.comm import ledger"),
    ],
)
def test_the_ground_floor_check_fails_on_an_import_up_it(module, planted):
    """The ground floor is one way: a room imports only the rooms below it (processes, pieces, comm, proof)."""
    assert floor_breaks(planted, module)
    assert not floor_breaks("from distlab.processes.runtime import distributed\n", module)
    assert not floor_breaks("from distlab.comm.ledger import Ledger\n", "distlab.proof.training")


def test_the_top_floor_may_import_every_floor():
    source = "from distlab.data_split.sharding import accounting\n"
    source += "from distlab.layer_split.tensor_parallel.cost import activation_bytes\n"
    assert not floor_breaks(source + "from distlab.cost.flops import forward\n", "distlab.plan.search")
    assert not floor_breaks(source, "distlab.cost.memory")
    assert not floor_breaks(source + "from distlab.composed.dims import ParallelDims\n", "distlab.composed.cost")
    assert floor_breaks(source, "distlab.layer_split.context_parallel.cost")  # the same imports from a sibling break


def test_a_package_may_import_itself_relatively_or_not():
    source = (
        "from . import torch_tiles\nfrom .sigmoid import Logits\nfrom distlab.streamed.config import parse_config\n"
    )
    assert imports(source, "distlab.streamed.step") == [
        "distlab.streamed",
        "distlab.streamed.torch_tiles",
        "distlab.streamed.sigmoid",
        "distlab.streamed.sigmoid.Logits",
        "distlab.streamed.config",
        "distlab.streamed.config.parse_config",
    ]
    assert not floor_breaks(source, "distlab.streamed.step")


@pytest.mark.parametrize("planted", ["import helpers", "from tests.helpers import torchrun", "import test_comm"])
def test_the_one_way_check_fails_on_a_planted_import(planted):
    assert outside_imports(planted, "distlab.proof.compare")
    assert not outside_imports("from distlab.processes.console import print0", "distlab.proof.compare")


def test_no_import_circle():
    """No circle of any size, deferred imports included: every import points down."""
    found = circles(import_graph(library_sources()))
    assert found == [], found


def test_the_circle_check_fails_on_a_planted_deferred_import():
    """The launch warning counting the step it warns about, as it once did: a function-level import of the
    module that counts one rank's step closes a circle through the step. And the two-module circle that was:
    strict device mode checking a Runtime that `distributed(strict=True)` hands it, imported both ways."""
    sources = library_sources()
    text, package = sources["distlab.streamed.chunk_size"]
    planted = "\n\ndef counted():\n    from distlab.streamed.rank_work import count_rank\n"
    sources["distlab.streamed.chunk_size"] = (text + planted, package)
    circle = next(c for c in circles(import_graph(sources)) if "distlab.streamed.chunk_size" in c)
    assert len(circle) > 2 and {"distlab.streamed.step", "distlab.streamed.rank_work"} <= set(circle), circle
    sources = library_sources()
    text, package = sources["distlab.processes.strict"]
    sources["distlab.processes.strict"] = (text + "\nfrom distlab.processes.runtime import DEVICE_CHOICES\n", package)
    assert ["distlab.processes.runtime", "distlab.processes.strict"] in circles(import_graph(sources))


def test_circles_are_found_and_a_package_import_is_its_submodule():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a", "e"}, "e": {"d"}, "f": set()}
    assert sorted(circles(graph)) == [["a", "b", "c"], ["d", "e"]]
    known = {"distlab.streamed", "distlab.streamed.step", "distlab.streamed.config"}
    source = "from distlab.streamed import step\nfrom distlab.streamed.config import parse_config\n"
    found = imported_modules(source, "distlab.streamed.ring_passes", known)
    assert found == {"distlab.streamed.step", "distlab.streamed.config"}
