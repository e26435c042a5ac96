"""The import rules beyond the floors (tests/test_layering.py): no import inside a function dodges a circle (each
deferred import of a distlab module is listed with the heavy dependency it postpones); each lesson imports its own
part's rooms and the floors below it in the arc, never a later part's; and no argparse namespace crosses into the
library (the lessons hold their flags). Each check is shown to fail on a planted import."""

import ast

import pytest
from layering_helpers import (
    FLOORED,
    GROUND_PACKAGES,
    LIBRARY,
    ROOT,
    SIBLINGS,
    TOP_PACKAGES,
    imports,
    module_name,
    room_of,
)

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
FORWARD: dict[tuple[int, str], str] = {}  # none: the datasheets lesson 11 prices on are on the ground floor


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
        (6, "from distlab.cost.timing import predict"),
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
NAMESPACE_TAKERS: set[str] = set()  # none: every library function takes typed values


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
