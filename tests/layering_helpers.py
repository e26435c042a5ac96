"""What tests/test_layering.py and tests/test_import_rules.py share: the rooms of distlab, every import a source
makes (as absolute dotted names, relative ones resolved, also inside functions), the room a name lies in, and the
import graph with its circles (Tarjan's algorithm). Read from the source alone, no import of distlab."""

import ast
from pathlib import Path

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
LIBRARY = sorted(SRC.rglob("*.py"))  # distlab, and distributed_clip.py: the public path to the streamed step
FLOORED = sorted(DISTLAB.rglob("*.py"))


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


def room_of(name: str) -> str | None:
    """The room a dotted name lies in: distlab.layer_split.tensor_parallel.cost -> layer_split.tensor_parallel,
    distlab.proof.compare -> proof; None outside distlab or for distlab itself (or a part's own folder)."""
    inside = name.split(".")[1:] if name.split(".")[0] == "distlab" else []
    return next((".".join(inside[:k]) for k in (2, 1) if ".".join(inside[:k]) in ROOMS), None)


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
