"""docs/layout.md holds the tree and a glossary, and both say what the tree holds: every entry of the glossary
exists where it says (a module, a package, or a name defined at the top of its module), no name is listed twice
(one name per idea), every package of distlab is listed, and every module of distlab is named in the layout. Read
from the source alone (no import), so the check is cheap."""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src"
LAYOUT = ROOT / "docs" / "layout.md"
ROW = re.compile(r"^\| `(?P<name>[\w.]+)` \| `(?P<where>[\w.]+)` \| (?P<meaning>[^|]+) \|$", re.M)


def glossary(text: str) -> list[tuple[str, str, str]]:
    return [(m["name"], m["where"], m["meaning"].strip()) for m in ROW.finditer(text.split("## Glossary", 1)[-1])]


def defined(module: Path) -> set[str]:
    """The names a module defines at its top: functions, classes, assignments (annotated too), and the names a
    public path imports to export (`distributed_clip`'s)."""
    names = set()
    for node in ast.parse(module.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
        elif isinstance(node, ast.ImportFrom) and module.parent == SRC:
            names |= {alias.asname or alias.name for alias in node.names}
    return names


def missing(where: str, src: Path = SRC) -> str | None:
    """Why `where` (a dotted module, package or module.name) is not in the tree, or None when it is."""
    parts = where.split(".")
    for k in range(len(parts), 0, -1):
        path = src.joinpath(*parts[:k])
        module = path.with_suffix(".py") if path.with_suffix(".py").is_file() else path / "__init__.py"
        if module.is_file():
            rest = parts[k:]
            if not rest:
                return None
            if len(rest) == 1 and rest[0] in defined(module):
                return None
            return f"{where}: {'.'.join(rest)} is not defined at the top of {module.relative_to(src)}"
    return f"{where}: no such module"


def packages() -> list[str]:
    return sorted(
        ".".join(p.parent.relative_to(SRC).parts) for p in (SRC / "distlab").rglob("__init__.py") if p.parent != SRC
    )


def test_every_glossary_entry_exists_where_it_says():
    entries = glossary(LAYOUT.read_text())
    assert len(entries) >= 40
    problems = [why for _, where, _ in entries if (why := missing(where))]
    assert not problems, problems
    assert all(where.rsplit(".", 1)[-1] == name for name, where, _ in entries), "a name is its path's last part"


def test_one_name_per_idea():
    names = [name for name, _, _ in glossary(LAYOUT.read_text())]
    assert len(names) == len(set(names)), sorted({n for n in names if names.count(n) > 1})


def test_every_package_is_in_the_glossary():
    listed = {where for _, where, _ in glossary(LAYOUT.read_text())}
    assert not [p for p in packages() if p != "distlab" and p not in listed]


def test_every_module_is_named_in_the_layout():
    text = LAYOUT.read_text()
    modules = [p for p in (SRC / "distlab").rglob("*.py") if p.name != "__init__.py"]
    assert not [str(p.relative_to(SRC)) for p in modules if p.name not in text]


@pytest.mark.parametrize(
    "where",
    [
        "distlab.processes.runtime.Runtime",  # it lives in identity now
        "distlab.proof.consoles",  # no such module
        "distlab.model_split.runner.NoSuchName",
        "distlab.proof.memory.NOT_A_NAME",
    ],
)
def test_the_glossary_check_fails_on_a_wrong_entry(where):
    assert missing(where)
    row = f"| `{where.rsplit('.', 1)[-1]}` | `{where}` | planted |\n"
    assert glossary("## Glossary\n" + row)[0][1] == where
