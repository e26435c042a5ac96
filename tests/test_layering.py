"""The library is built in floors of named rooms, and its imports say so.

`ls src/distlab` shows the architecture: packages only, no loose module, each one named here. The ground floor
has four rooms: `processes` (torchrun's environment, the process group, devices, flags and the lessons'
command line), `comm` (the collectives, the exchange, the ledger), `proof` (the models a check trains, the
training loop, the reference, the comparison, the measurements, the verdict) and `pieces` (a batch computed in
pieces exactly as the whole). On it stand the sibling packages, one per parallelism or step (pipeline,
data_parallel, sharding, tensor_parallel, context_parallel, expert_parallel, contrastive, streamed): each
imports the ground floor and itself, never a sibling, so each can be read, changed and tested on its own. The
ground floor imports no sibling. On top stand the packages that read every parallelism at once (`distlab.cost`:
a step's cost from each lesson's formula; `distlab.plan`, the planner on it; `distlab.composed`, lesson 12's
dp x pp x tp x cp mesh, whose shape is the cost model's `ParallelDims` and whose closed forms import lessons 08
and 09's instead of deriving them again): they may import any floor below and each other, and nothing below
imports them. And data flows one way: lessons, tests and benchmarks import `distlab`, `distlab` never imports
a lesson, a test or the lessons' command line (`distlab.processes.cli`).

Each rule is checked on the source (every import statement, also inside functions, relative ones
resolved), and each check is shown to fail on a planted import. No import circle of more than two modules exists
anywhere in the library, deferred imports included (an import inside a function that closes a circle is still
the circle: the streamed step's launch warning once closed one of nine modules that way). The two-module circles
left are a pair each, one idea in two files: `processes.runtime` and `processes.strict` (strict device mode
checks tensors against a `Runtime`'s device; `distributed(strict=True)` turns it on), `streamed.sigmoid` and
`streamed.kernel_choice` (the sigmoid's torch-tile block is one of the choices; the sigmoid loss takes a choice).
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src"
DISTLAB = SRC / "distlab"
GROUND_PACKAGES = ("processes", "comm", "proof", "pieces")  # the ground floor's rooms
PARTS = ("data_split", "layer_split")  # a part of the arc: a folder of its sibling packages, and nothing else
SIBLINGS = (  # one package per way of splitting training, or per step: each imports the ground floor only
    "pipeline",
    "data_split.data_parallel",
    "data_split.sharding",
    "layer_split.tensor_parallel",
    "layer_split.context_parallel",
    "layer_split.expert_parallel",
    "contrastive",
    "streamed",
)
TOP_PACKAGES = ("cost", "plan", "composed")  # the top floor: they read every sibling's formulas
ROOMS = GROUND_PACKAGES + SIBLINGS + TOP_PACKAGES
PACKAGES = sorted(p.name for p in DISTLAB.iterdir() if (p / "__init__.py").is_file())
LESSONS_PARSER = "distlab.processes.cli"  # the lessons' command line: lessons, tests and benchmarks only
LIBRARY = sorted(SRC.rglob("*.py"))  # distlab, and distributed_clip.py: the public path to the streamed step
FLOORED = sorted(DISTLAB.rglob("*.py"))
OUTSIDE = ("lessons", "tests", "helpers", "nbhelpers", "exercise_kit")  # what the library never imports


def module_name(path: Path) -> str:
    """distlab/streamed/ring.py -> distlab.streamed.ring; a package's __init__.py is the package."""
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(source: str, module: str, is_package: bool = False) -> list[str]:
    """Every module `source` (the text of module `module`) imports, as absolute dotted names; for
    `from pkg import name` both pkg and pkg.name (name may be a submodule)."""
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, one level up per extra dot
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found += [base] + [f"{base}.{alias.name}" for alias in node.names]
    return found


def floor_breaks(source: str, module: str, is_package: bool = False) -> list[str]:
    """The imports of `module` that cross a floor: any sibling from the ground floor, another sibling from
    a sibling, the top floor from anything below it. The top floor itself may import every floor."""
    own = room_of(module)
    if own in TOP_PACKAGES:
        return []
    breaks = []
    for name in imports(source, module, is_package):
        target = room_of(name)
        if (target in SIBLINGS and target != own) or target in TOP_PACKAGES:
            breaks.append(f"{module} imports {name}")
    return sorted(set(breaks))


def room_of(name: str) -> str | None:
    """The room a dotted name lies in: distlab.layer_split.tensor_parallel.cost -> layer_split.tensor_parallel,
    distlab.proof.compare -> proof; None outside distlab or for distlab itself (or a part's own folder)."""
    inside = name.split(".")[1:] if name.split(".")[0] == "distlab" else []
    return next((".".join(inside[:k]) for k in (2, 1) if ".".join(inside[:k]) in ROOMS), None)


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
    names its floor. `ls src/distlab` shows at most 12 entries besides __init__.py."""
    assert len(set(ROOMS + PARTS)) == len(ROOMS + PARTS)
    top = {room.split(".")[0] for room in ROOMS}
    assert entries(DISTLAB) == PACKAGES == sorted(top), set(entries(DISTLAB)) ^ top
    for part in PARTS:
        assert [f"{part}.{name}" for name in entries(DISTLAB / part)] == sorted(r for r in ROOMS if r.startswith(part))
    assert len(entries(DISTLAB)) <= 12 and len(FLOORED) > 50


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
        "from distlab.processes.cli import LessonParser",
        "from distlab.processes import cli",
        "import distlab.processes.cli",
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
        ("distlab.contrastive.cost", "from ..pipeline import p2p"),
        ("distlab.comm.ring", "from distlab.data_split.data_parallel.ring import Ring"),  # the ground floor, upwards
        ("distlab.processes.runtime", "from distlab.streamed.peers import naming_dead_peers"),
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
    source = "from distlab.proof.compare import compare\nfrom distlab.comm.p2p import post\n" + planted
    assert floor_breaks(source, module)
    assert not floor_breaks(
        "from distlab.proof.compare import compare\nfrom distlab.comm.ledger import Ledger\n", module
    )


def test_the_top_floor_may_import_every_floor():
    source = "from distlab.data_split.sharding import accounting\n"
    source += "from distlab.layer_split.tensor_parallel.cost import activation_bytes\n"
    assert not floor_breaks(source + "from distlab.cost.flops import forward\n", "distlab.plan.search")
    assert not floor_breaks(source, "distlab.cost.memory")
    assert not floor_breaks(source + "from distlab.cost.dims import ParallelDims\n", "distlab.composed.cost")
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
    assert not outside_imports("from distlab.proof.console import print0", "distlab.proof.compare")


def imported_modules(source: str, module: str, known: set[str], is_package: bool = False) -> set[str]:
    """The modules of `known` that `module` imports: `from pkg import sub` is the submodule sub (not pkg, whose
    __init__ Python runs for every import below it anyway), `from pkg.mod import name` is pkg.mod."""
    names = [name for name in imports(source, module, is_package) if name in known and name != module]
    return {name for name in names if not any(other.startswith(name + ".") for other in names)}


def import_graph(sources: dict[str, tuple[str, bool]]) -> dict[str, set[str]]:
    """module -> the modules it imports, from {module: (its source, whether it is a package's __init__)}."""
    known = set(sources)
    return {module: imported_modules(text, module, known, package) for module, (text, package) in sources.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import circle: the strongly connected components of more than one module (Tarjan's algorithm,
    iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            module, targets = work[-1]
            target = next(targets, None)
            if target is not None:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                elif target in on_stack:
                    low[module] = min(low[module], index[target])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[module])
            if low[module] == index[module]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == module:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def library_sources() -> dict[str, tuple[str, bool]]:
    return {module_name(path): (path.read_text(), path.name == "__init__.py") for path in FLOORED}


def test_no_import_circle_of_more_than_two_modules():
    found = circles(import_graph(library_sources()))
    assert not [circle for circle in found if len(circle) > 2], found


def test_the_circle_check_fails_on_a_planted_deferred_import():
    """The launch warning counting the step it warns about, as it once did: a function-level import of the
    module that counts one rank's step closes a circle through the step."""
    sources = library_sources()
    text, package = sources["distlab.streamed.chunk_size"]
    planted = "\n\ndef counted():\n    from distlab.streamed.rank_work import count_rank\n"
    sources["distlab.streamed.chunk_size"] = (text + planted, package)
    circle = next(c for c in circles(import_graph(sources)) if "distlab.streamed.chunk_size" in c)
    assert len(circle) > 2 and {"distlab.streamed.step", "distlab.streamed.rank_work"} <= set(circle), circle


def test_circles_are_found_and_a_package_import_is_its_submodule():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a", "e"}, "e": {"d"}, "f": set()}
    assert sorted(circles(graph)) == [["a", "b", "c"], ["d", "e"]]
    known = {"distlab.streamed", "distlab.streamed.step", "distlab.streamed.config"}
    source = "from distlab.streamed import step\nfrom distlab.streamed.config import parse_config\n"
    found = imported_modules(source, "distlab.streamed.ring", known)
    assert found == {"distlab.streamed.step", "distlab.streamed.config"}
