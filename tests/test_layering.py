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
dodge one: each deferred import of a distlab module is listed in `DEFERRED` with the heavy dependency it
postpones.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src"
DISTLAB = SRC / "distlab"
GROUND_PACKAGES = ("processes", "pieces", "comm", "proof")  # the ground floor's rooms, bottom first
PARTS = ("data_split", "layer_split")  # a part of the arc: a folder of its sibling packages, and nothing else
SIBLINGS = (  # one package per way of splitting training, or per step: each imports the ground floor only
    "model_split",
    "data_split.data_parallel",
    "data_split.sharding",
    "layer_split.tensor_parallel",
    "layer_split.context_parallel",
    "layer_split.expert_parallel",
    "resilience",
    "contrastive",
    "streamed",
)
TOP_PACKAGES = ("cost", "plan", "composed")  # the top floor: they read every sibling's formulas
ROOMS = GROUND_PACKAGES + SIBLINGS + TOP_PACKAGES
PACKAGES = sorted(p.name for p in DISTLAB.iterdir() if (p / "__init__.py").is_file())
LESSONS_PARSER = "distlab.proof.cli"  # the lessons' command line: lessons, tests and benchmarks only
LIBRARY = sorted(SRC.rglob("*.py"))  # distlab, and distributed_clip.py: the public path to the streamed step
FLOORED = sorted(DISTLAB.rglob("*.py"))
OUTSIDE = ("lessons", "tests", "helpers", "nbhelpers", "exercise_kit")  # what the library never imports


def module_name(path: Path) -> str:
    """distlab/streamed/ring_passes.py -> distlab.streamed.ring_passes; a package's __init__.py is the package."""
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


# Every import of a distlab module inside a function, by (importing module, imported module or package): the
# heavy dependency it postpones. Anything else belongs at the top of its module, where a circle would show.
DEFERRED = {
    ("distlab.processes.flags", "distlab.processes.committed"): "flags imports no torch (a parser answers --help "
    "without it); a checkpoint folder's check needs torch.distributed, only when a lesson asks for one",
    ("distlab.streamed.kernel_choice", "distlab.streamed.kernels"): "Triton, only when KERNELS chooses a kernel "
    "(a CPU install has none to import)",
}


def deferred_imports(source: str, module: str, is_package: bool = False) -> list[tuple[str, str]]:
    """(module, the distlab module it imports) for every import statement inside a function of `source`."""
    found = []
    for function in ast.walk(ast.parse(source)):
        if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            body = ast.Module(body=function.body, type_ignores=[])
            found += [
                (module, name) for name in imports(ast.unparse(body), module, is_package) if name.startswith("distlab")
            ]
    return found


def undeclared_deferred(source: str, module: str, is_package: bool = False) -> list[str]:
    """The deferred imports of `module` that DEFERRED gives no reason for."""
    return sorted(
        {
            f"{module} imports {name} inside a function"
            for module, name in deferred_imports(source, module, is_package)
            if not any(module == m and (name == t or name.startswith(t + ".")) for m, t in DEFERRED)
        }
    )


def test_no_import_inside_a_function_dodges_a_circle():
    offenders = [
        b
        for path in FLOORED
        for b in undeclared_deferred(path.read_text(), module_name(path), path.name == "__init__.py")
    ]
    assert not offenders, offenders
    seen = {key for path in FLOORED for key in deferred_imports(path.read_text(), module_name(path))}
    stale = [key for key in DEFERRED if not any(m == key[0] and t.startswith(key[1]) for m, t in seen)]
    assert not stale, f"DEFERRED lists deferred imports that no longer exist: {stale}"


@pytest.mark.parametrize(
    "module,planted",
    [
        ("distlab.processes.runtime", "def f(rt):\n    from distlab.processes.strict import strict_device\n"),
        ("distlab.streamed.kernel_choice", "class A:\n    def f(self):\n        import distlab.streamed.step\n"),
        ("distlab.processes.flags", "async def f():\n    from distlab.processes import runtime\n"),
    ],
)
def test_the_deferred_check_fails_on_a_planted_import(module, planted):
    assert undeclared_deferred(planted, module)
    assert not undeclared_deferred("from distlab.processes.strict import strict_device\n", module)
    assert not undeclared_deferred("def f():\n    import torch\n", module)


def test_circles_are_found_and_a_package_import_is_its_submodule():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a", "e"}, "e": {"d"}, "f": set()}
    assert sorted(circles(graph)) == [["a", "b", "c"], ["d", "e"]]
    known = {"distlab.streamed", "distlab.streamed.step", "distlab.streamed.config"}
    source = "from distlab.streamed import step\nfrom distlab.streamed.config import parse_config\n"
    found = imported_modules(source, "distlab.streamed.ring_passes", known)
    assert found == {"distlab.streamed.step", "distlab.streamed.config"}


# The README's parts in the order of the arc: their lessons and the rooms that hold their mechanisms. A lesson
# imports the ground floor, its own part's rooms and the rooms of the parts before it (what it builds on: 16 is
# 07's activations offloaded, 18 extends 08's layers, 19 05's runner, 24 06's DDP), never a later part's.
ARC = (
    ("model split", range(1, 6), ("model_split",)),
    ("data split", range(6, 8), ("data_split.data_parallel", "data_split.sharding")),
    (
        "layer split",
        range(8, 12),
        ("layer_split.tensor_parallel", "layer_split.context_parallel", "layer_split.expert_parallel"),
    ),
    ("composed", range(12, 13), ("composed",)),
    ("cost", range(13, 14), ("cost", "plan")),
    ("fewer bytes", range(14, 18), ()),  # their mechanisms are written out in the lessons
    ("overlap and resilience", range(18, 21), ("resilience",)),
    ("contrastive", range(21, 28), ("contrastive", "streamed")),  # `distributed_clip`: the streamed step's path
)
# a lesson's import of a later part, with its reason
FORWARD = {
    (11, "cost"): "the crossover priced on the datasheets' GPUs and links (`cost.hardware`, the one table of them)",
}


def lesson_breaks(source: str, number: int) -> list[str]:
    """The imports of lesson `number` from a room of a later part of the arc (FORWARD's excepted)."""
    part = next(k for k, (_, lessons, _) in enumerate(ARC) if number in lessons)
    allowed = set(GROUND_PACKAGES).union(*(rooms for _, _, rooms in ARC[: part + 1]))
    breaks = []
    for name in imports(source, f"lessons.{number:02d}"):
        room = "streamed" if name.split(".")[0] == "distributed_clip" else room_of(name)
        if room is not None and room not in allowed and (number, room) not in FORWARD:
            breaks.append(f"lesson {number:02d} imports {name}")
    return sorted(set(breaks))


def test_the_arc_names_every_lesson_and_every_room():
    numbers = sorted(int(path.name[:2]) for path in (ROOT / "lessons").glob("[0-9][0-9]_*.py"))
    assert numbers == [n for _, lessons, _ in ARC for n in lessons]
    assert sorted(room for _, _, rooms in ARC for room in rooms) == sorted(SIBLINGS + TOP_PACKAGES)


def test_each_lesson_imports_its_own_part_and_the_floors_below():
    paths = sorted((ROOT / "lessons").glob("[0-9][0-9]_*.py")) + sorted((ROOT / "lessons" / "exercises").glob("*.py"))
    breaks = [
        b for path in paths if path.name[:2].isdigit() for b in lesson_breaks(path.read_text(), int(path.name[:2]))
    ]
    assert not breaks, breaks


@pytest.mark.parametrize(
    "number,planted",
    [
        (9, "def show_fold():\n    from distlab.streamed import torch_tiles\n"),  # as it was
        (6, "from distlab.cost.hardware import DEVICES"),
        (20, "import distributed_clip"),
        (3, "from distlab.data_split.data_parallel import ddp"),
    ],
)
def test_the_lesson_check_fails_on_a_planted_import(number, planted):
    assert lesson_breaks(planted, number)
    assert not lesson_breaks("from distlab.proof.verdict import Verdict\nfrom distlab.comm.ring import Ring\n", number)
    assert not lesson_breaks("from distlab.model_split.runner import PipelineStep\n", number)  # the first part


# The modules that hold a command line: the library's flag types and rules, the lessons' parser, the planner's.
PARSERS = ("distlab.processes.flags", "distlab.proof.cli", "distlab.plan.cli", "distlab.plan.flags")
# TODO(issue 47, the `planner` branch owns cost/ and plan/): these take the planner's or lesson 13's namespace
NAMESPACE_TAKERS = {"distlab.cost.trial.build", "distlab.cost.trial.Trial.__init__", "distlab.plan.report.header"}


def namespace_crossings(source: str, module: str) -> list[str]:
    """Where an argparse namespace enters `module`: an `argparse` import, or a parameter annotated `Namespace`
    or named `args` / `namespace` whose attributes the function reads (`args.steps`: a namespace, not a tuple)."""
    if module in PARSERS:
        return []
    found = []
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(alias.name == "argparse" for alias in node.names):
            found.append(f"{module} imports argparse")
        elif isinstance(node, ast.ImportFrom) and node.module == "argparse":
            found.append(f"{module} imports from argparse")
    for owner, function in functions(tree, module):
        arguments = function.args.posonlyargs + function.args.args + function.args.kwonlyargs
        read = {
            n.value.id for n in ast.walk(function) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
        }
        for argument in arguments:
            annotated = argument.annotation is not None and "Namespace" in ast.unparse(argument.annotation)
            if (annotated or (argument.arg in ("args", "namespace") and argument.arg in read)) and (
                f"{owner}.{function.name}" not in NAMESPACE_TAKERS
            ):
                found.append(f"{owner}.{function.name} takes a namespace ({argument.arg})")
    return sorted(set(found))


def functions(tree: ast.AST, owner: str):
    """(dotted owner, function) for every function, methods and nested ones included."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield owner, node
            yield from functions(node, f"{owner}.{node.name}")
        elif isinstance(node, ast.ClassDef):
            yield from functions(node, f"{owner}.{node.name}")


def test_no_argparse_namespace_crosses_into_the_library():
    """The lessons hold their flags: what the library needs from them it takes as plain typed values."""
    crossings = [c for path in LIBRARY for c in namespace_crossings(path.read_text(), module_name(path))]
    assert not crossings, crossings


@pytest.mark.parametrize(
    "planted",
    [
        "import argparse\n",
        "from argparse import Namespace\n",
        "def emulated_overlap(rt, cfg, args, buckets_class):\n    return args.emulate_ms\n",  # as it was
        "def check(args: 'argparse.Namespace') -> None:\n    pass\n",
        "class Checkpoints:\n    @classmethod\n    def from_args(cls, args, rt):\n        return cls(args.steps)\n",
    ],
)
def test_the_namespace_check_fails_on_a_planted_one(planted):
    assert namespace_crossings(planted, "distlab.data_split.data_parallel.overlap")
    assert not namespace_crossings(planted, "distlab.proof.cli")
    assert not namespace_crossings("def dispatch(func, types, args=(), kwargs=None):\n    return func(*args)\n", "m")
