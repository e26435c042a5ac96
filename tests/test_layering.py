"""The library is built in floors, and its imports say so.

The ground floor is every top-level module of `distlab` (runtime, compare, console, models, ...) and its
shared packages (`distlab.comm`: the collectives, the exchange, the ledger). On it stand the sibling
packages, one per parallelism or step (pipeline, data_parallel, sharding, tensor_parallel,
context_parallel, contrastive, streamed): each imports the ground floor and itself, never a sibling, so
each can be read, changed and tested on its own. The ground floor imports no sibling. On top stand the
packages that read every parallelism at once (`distlab.cost`: a step's cost from each lesson's formula;
`distlab.plan`, the planner on it; `distlab.composed`, lesson 12's dp x pp x tp x cp mesh, whose shape is
the cost model's `ParallelDims` and whose closed forms import lessons 08 and 09's instead of deriving them
again): they may import any floor below and each other, and nothing below imports them. And
data flows one way: lessons, tests and benchmarks import `distlab`, `distlab` never imports a lesson or a
test.

Each rule is checked on the source (every import statement, also inside functions, relative ones
resolved), and each check is shown to fail on a planted import.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src"
DISTLAB = SRC / "distlab"
GROUND_PACKAGES = ("comm",)  # shared packages of the ground floor
TOP_PACKAGES = ("cost", "plan", "composed")  # the top floor: they read every sibling's formulas
PACKAGES = sorted(p.name for p in DISTLAB.iterdir() if (p / "__init__.py").is_file())
SIBLINGS = [name for name in PACKAGES if name not in GROUND_PACKAGES + TOP_PACKAGES]
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
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in TOP_PACKAGES:
        return []
    own = parts[1] if len(parts) > 1 and parts[1] in SIBLINGS else None
    breaks = []
    for name in imports(source, module, is_package):
        target = name.split(".")
        if target[0] != "distlab" or len(target) < 2:
            continue
        if (target[1] in SIBLINGS and target[1] != own) or target[1] in TOP_PACKAGES:
            breaks.append(f"{module} imports {name}")
    return sorted(set(breaks))


def outside_imports(source: str, module: str) -> list[str]:
    """The imports of `module` that reach a lesson, a test or a test helper."""
    return sorted(
        {
            f"{module} imports {name}"
            for name in imports(source, module)
            if name.split(".")[0] in OUTSIDE or name.split(".")[0].startswith("test_")
        }
    )


def test_the_floors_are_what_the_tree_holds():
    assert set(GROUND_PACKAGES) <= set(PACKAGES) and set(TOP_PACKAGES) <= set(PACKAGES)
    assert {"pipeline", "data_parallel", "sharding", "tensor_parallel", "context_parallel"} <= set(SIBLINGS)
    assert {"contrastive", "streamed"} <= set(SIBLINGS) and len(FLOORED) > 50


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
        ("distlab.sharding.zero", "from distlab import data_parallel"),
        ("distlab.tensor_parallel.cost", "def f():\n    import distlab.sharding.accounting\n"),
        ("distlab.contrastive.cost", "from ..pipeline import p2p"),
        ("distlab.comm.ring", "from distlab.data_parallel.ring import Ring"),  # the ground floor, upwards
        ("distlab.runtime", "from distlab.streamed.peers import naming_dead_peers"),
        ("distlab.sharding.accounting", "from distlab.cost.memory import model_states"),  # the top floor, from below
        ("distlab.models", "import distlab.plan"),
        ("distlab.tensor_parallel.cost", "from distlab.composed.config import Shape"),  # the top floor, from a sibling
    ],
)
def test_the_floor_check_fails_on_a_planted_import(module, planted):
    source = "from distlab.compare import compare\nfrom distlab.comm.p2p import post\n" + planted
    assert floor_breaks(source, module)
    assert not floor_breaks("from distlab.compare import compare\nfrom distlab.comm.ledger import Ledger\n", module)


def test_the_top_floor_may_import_every_floor():
    source = "from distlab.sharding import accounting\nfrom distlab.tensor_parallel.cost import activation_bytes\n"
    assert not floor_breaks(source + "from distlab.cost.flops import forward\n", "distlab.plan.search")
    assert not floor_breaks(source, "distlab.cost.memory")
    assert not floor_breaks(source + "from distlab.cost.dims import ParallelDims\n", "distlab.composed.cost")
    assert floor_breaks(source, "distlab.context_parallel.cost")  # the same imports from a sibling break


def test_a_package_may_import_itself_relatively_or_not():
    source = "from . import tiles\nfrom .sigmoid import Logits\nfrom distlab.streamed.config import parse_config\n"
    assert imports(source, "distlab.streamed.step") == [
        "distlab.streamed",
        "distlab.streamed.tiles",
        "distlab.streamed.sigmoid",
        "distlab.streamed.sigmoid.Logits",
        "distlab.streamed.config",
        "distlab.streamed.config.parse_config",
    ]
    assert not floor_breaks(source, "distlab.streamed.step")


@pytest.mark.parametrize("planted", ["import helpers", "from tests.helpers import torchrun", "import test_comm"])
def test_the_one_way_check_fails_on_a_planted_import(planted):
    assert outside_imports(planted, "distlab.compare")
    assert not outside_imports("from distlab.console import print0", "distlab.compare")
