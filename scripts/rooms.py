"""Give the ground floor its rooms: move `distlab`'s loose top-level modules into packages, and rewrite every
reference to them.

`MODULES` below is the data: each old module path and its new one (a package moves the same way, with every
module under it). `NAMES` moves single names out of a module that was split (the lessons' command line, whose
flag types and rules and constants now live with their owners). The script makes the tree agree with them:

- moves, for every old module whose file is still there, `src/distlab/<old>.py` to its new path (`git mv` in a
  git work tree, so history follows), and a package file by file (a file a late branch added to the old package
  follows the rest), making a room's `__init__.py` from `ROOMS` when it is missing;
- rewrites, in every text file of the tree but the records of past runs (`benchmarks/results/` keeps the paths
  the modules had when they ran) and this script and its test (their examples are not references):
  `from distlab import runtime, compare` (one statement per new parent), `from distlab.cli import DTYPES, ...`
  (a moved name goes to its owner), `from distlab.streamed import tiles` (a module renamed where it is keeps the
  name the file knew it by: `import torch_tiles as tiles`), every dotted `distlab.<old>` (imports,
  `mock.patch("distlab.runtime.x")`, prose) and every file path `distlab/<old>.py`. In a notebook only the
  cells' sources are rewritten, never an output, and the notebook is written back in nbformat's layout.

An old path never starts a new one, so a second run finds nothing to move or rewrite and changes nothing
(idempotent): after merging a branch that still uses the old paths, run it again and it rewrites only what that
branch brought. It prints each file it moved or rewrote.

    python scripts/rooms.py            # move and rewrite, then report
    python scripts/rooms.py --check    # change nothing; exit 1 if anything would change

Not part of the library: it edits the repository, it is not imported by it.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

# old module -> new module (the rooms of the ground floor; modules that serve one lesson, in its package)
MODULES = {
    # the processes a run stands on: torchrun's env, groups, devices, the command line
    "distlab.runtime": "distlab.processes.runtime",
    "distlab.spawn": "distlab.processes.spawn",
    "distlab.strict": "distlab.processes.strict",
    "distlab.reproducible": "distlab.processes.reproducible",
    "distlab.compat": "distlab.comm.compat",
    "distlab.agree": "distlab.comm.agree",
    "distlab.scratch": "distlab.processes.scratch",
    "distlab.committed": "distlab.processes.committed",
    "distlab.cli": "distlab.proof.cli",
    # the proof machinery: what a check trains, its reference, its comparison, its measurements, its verdict
    "distlab.models": "distlab.proof.models",
    "distlab.training": "distlab.proof.training",
    "distlab.reference": "distlab.proof.reference",
    "distlab.compare": "distlab.proof.compare",
    "distlab.verdict": "distlab.proof.verdict",
    "distlab.console": "distlab.processes.console",
    "distlab.held": "distlab.proof.held",
    "distlab.memory": "distlab.proof.memory",
    "distlab.timeline": "distlab.proof.timeline",
    "distlab.emulate": "distlab.proof.emulate",
    # a batch computed in pieces, exactly as the whole
    "distlab.online_softmax": "distlab.pieces.online_softmax",
    "distlab.chunks": "distlab.pieces.chunks",
    "distlab.split_inputs": "distlab.pieces.split_inputs",
    "distlab.random_state": "distlab.pieces.random_state",
    # modules that serve one lesson, in that lesson's package (lessons 24 and 27)
    "distlab.checkpointing": "distlab.contrastive.checkpointing",
    "distlab.optim": "distlab.contrastive.optim",
    "distlab.step_cost": "distlab.contrastive.measured_step",
    # the parts of the arc that hold several ways of splitting: data split (06-07), layer split (08-11)
    "distlab.data_parallel": "distlab.data_split.data_parallel",
    "distlab.sharding": "distlab.data_split.sharding",
    "distlab.tensor_parallel": "distlab.layer_split.tensor_parallel",
    "distlab.context_parallel": "distlab.layer_split.context_parallel",
    "distlab.expert_parallel": "distlab.layer_split.expert_parallel",
    # the streamed step's modules named for what differs between them (issue 40): the tile work in torch ops
    # (S tiles in memory) against the kernels' S tile in registers; the choice between them (KERNELS); the
    # default T (the stream chunk); launches counted against the kernels' launching; the step's guards
    # against the loss modules'
    "distlab.streamed.tiles": "distlab.streamed.torch_tiles",
    "distlab.streamed.tile_ops": "distlab.streamed.kernel_choice",
    "distlab.streamed.tile_size": "distlab.streamed.chunk_size",
    "distlab.streamed.kernels.tile": "distlab.streamed.kernels.register_tile",
    "distlab.streamed.launches": "distlab.proof.launch_count",
    "distlab.streamed.guards": "distlab.streamed.safeguards.step_call",
    # issue 47. The ground floor one way, every import down: processes (the bottom), then pieces, comm, proof.
    # What a rank prints (the error line runtime prints) below the proof; the lessons' parser, whose defaults are
    # the proof's dtypes and widths, in the proof; the collectives' compatibility and agreeing in comm; the launch
    # counter lesson 07 and the streamed step both use on the floor beneath them.
    "distlab.proof.console": "distlab.processes.console",
    "distlab.processes.cli": "distlab.proof.cli",
    "distlab.processes.compat": "distlab.comm.compat",
    "distlab.processes.agree": "distlab.comm.agree",  # agreeing is an all-gather of a table (on compat's)
    "distlab.streamed.launch_count": "distlab.proof.launch_count",
    # rooms beside their users: the islands' torchft and the lives lesson 20 kills, in the part it belongs to
    # ("overlap and resilience", 18-20)
    "distlab.processes.lighthouse": "distlab.resilience.lighthouse",
    "distlab.processes.lives": "distlab.resilience.lives",
    # the README's part words: lessons 01-05 are the model split
    "distlab.pipeline": "distlab.model_split",
    # one idea per name: `comm.ring` is the ring collectives; the others say what they run on it
    "distlab.layer_split.context_parallel.ring": "distlab.layer_split.context_parallel.ring_attention",
    "distlab.streamed.ring": "distlab.streamed.ring_passes",
    # the streamed step's guards behind one door (issue 47), each named for what it guards: the step's call agreed
    # across ranks, a dead peer named, the exit hint on every error, a loss module's call agreed
    "distlab.streamed.step_guards": "distlab.streamed.safeguards.step_call",
    "distlab.streamed.peers": "distlab.streamed.safeguards.peers",
    "distlab.streamed.exit_hint": "distlab.streamed.safeguards.exit_hint",
    "distlab.streamed.loss_guards": "distlab.streamed.safeguards.loss_call",
    # the cost model's questions (a model by its sizes, the batch, the precision, the strategy): no shapes there
    "distlab.cost.shapes": "distlab.cost.inputs",
    # a run's shape and its mesh are lesson 12's (the composed mesh); the cost model (13) and the planner price it
    "distlab.cost.dims": "distlab.composed.dims",
    # the datasheets' GPUs and links, beside the emulated device and link: lesson 11 prices its crossover on them
    # before the cost model (13) and the planner price whole steps
    "distlab.cost.hardware": "distlab.proof.hardware",
}

# names split out of a module: (module, name) -> the module that owns the name now
_FLAGS = "distlab.processes.flags"
_MOVED_OUT_OF_CLI = {
    "DTYPES": "distlab.proof.compare",
    "MLP_IN": "distlab.proof.models",
    "MLP_OUT": "distlab.proof.models",
    "mlp_widths": "distlab.proof.models",
    **dict.fromkeys(
        (
            "positive_int",
            "nonnegative_int",
            "positive_float",
            "nonnegative_float",
            "fraction",
            "writable_file",
            "writable_dir",
            "checkpoint_dir",
            "require",
            "divides_global_batch",
            "launched_world_size",
            "check_flags_against_world",
        ),
        _FLAGS,
    ),
}
NAMES = {
    (module, name): owner
    for module in ("distlab.cli", "distlab.processes.cli", "distlab.proof.cli")
    for name, owner in _MOVED_OUT_OF_CLI.items()
}
# what tells a peer's death from the model's error serves every run now, not the streamed step alone
NAMES.update(
    dict.fromkeys(
        (("distlab.streamed.peers", n) for n in ("BACKEND_WORDS", "is_peer_failure")), "distlab.processes.nodes"
    )
)

# who a process is (`Runtime`) apart from how its group is made, so strict device mode (which checks a Runtime's
# device) and `distributed(strict=True)` (which turns it on) import one way (issue 47)
NAMES.update(
    {(module, "Runtime"): "distlab.processes.identity" for module in ("distlab.runtime", "distlab.processes.runtime")}
)

# the streamed guards' non-finite checks, split out of the step's call into their own module (issue 47)
NAMES.update(
    dict.fromkeys(
        (
            (module, name)
            for module in (
                "distlab.streamed.guards",
                "distlab.streamed.step_guards",
                "distlab.streamed.safeguards.step_call",
            )
            for name in ("agree_gradients_finite", "finite_flags")
        ),
        "distlab.streamed.safeguards.finite",
    )
)

# the gathered sigmoid loss's shares beside the exchange that gathers them, so the sigmoid's tile math imports no
# choice of tiles and the choice imports it (issue 47: the sigmoid <-> kernel_choice circle broken)
NAMES[("distlab.streamed.sigmoid", "sigmoid_gathered")] = "distlab.streamed.exchange"

# the docstring of a room, written when its __init__.py is missing (the committed ones say more)
ROOMS = {
    "distlab.processes": "The processes a run stands on: torchrun's environment, the process group, devices, flags.",
    "distlab.proof": "The proof machinery: the models a check trains, the reference, the comparison, the verdict.",
    "distlab.pieces": "A batch computed in pieces exactly as the whole: chunks, the online fold, replayed randomness.",
    "distlab.data_split": "The data split (lessons 06-07): data parallelism, and sharding what a step holds.",
    "distlab.layer_split": "The layer split (lessons 08-11): tensor, context and expert parallelism.",
    "distlab.resilience": "Overlap and resilience (lessons 18-20): islands that lose a member and heal, with torchft.",
}

SKIP_DIRS = {".git", "runs", "__pycache__", ".ipynb_checkpoints", ".pytest_cache", ".ruff_cache", "venv", ".venv"}
SELF = {"scripts/rooms.py", "tests/test_rooms.py", "tests/test_glossary.py"}  # their examples are not references
RECORDS = "benchmarks/results/"  # what a past run printed keeps the paths the modules had when it ran
TEXT_SUFFIXES = {".py", ".md", ".ipynb", ".sh", ".txt", ".toml", ".cfg", ".yml", ".yaml", ".rst", ".json"}
LINE = 120


def check_mapping() -> None:
    """An old path never starts a new one (else a second run would rewrite the first run's output)."""
    for old in MODULES:
        for new in MODULES.values():
            assert new != old and not new.startswith(old + "."), (old, new)


def dotted(old: str) -> re.Pattern:
    """`distlab.runtime` as a whole dotted name: not `distlab.runtimes`, not `x.distlab.runtime`."""
    return re.compile(rf"(?<![\w.]){re.escape(old)}(?![\w])")


def as_path(module: str) -> str:
    return module.replace(".", "/")


DOTTED = [(dotted(old), new) for old, new in MODULES.items()]
PATHS = [
    (re.compile(rf"(?<![\w.]){re.escape(as_path(old))}(?=\.py\b|/)"), as_path(new)) for old, new in MODULES.items()
]
FROM_IMPORT = re.compile(
    r"^(?P<indent>[ \t]*)from[ \t]+(?P<module>distlab(?:\.\w+)*)[ \t]+import[ \t]+"
    r"(?:\((?P<group>[^)]*)\)|(?P<line>[^\n(#]*?))(?P<comment>[ \t]*#[^\n]*)?$",
    re.M,
)


def import_names(text: str) -> list[str]:
    """`a, b as c,` -> ['a', 'b as c'] (comments inside a parenthesised list dropped)."""
    text = re.sub(r"#[^\n]*", "", text)
    return [" ".join(part.split()) for part in text.replace("\n", " ").split(",") if part.strip()]


def import_statement(indent: str, module: str, names: list[str]) -> str:
    one = f"{indent}from {module} import {', '.join(names)}"
    if len(one) <= LINE:
        return one
    inner = "".join(f"{indent}    {name},\n" for name in names)
    return f"{indent}from {module} import (\n{inner}{indent})"


def new_home(module: str, name: str) -> tuple[str, str]:
    """Where `name` of `from module import name` lives after the move (a submodule or a moved name), and the name
    to import it by there: a submodule renamed keeps the name the file used, `tiles` -> `torch_tiles as tiles`."""
    bare, _, alias = name.partition(" as ")
    if f"{module}.{bare}" in MODULES:
        home, _, leaf = MODULES[f"{module}.{bare}"].rpartition(".")
        return home, name if leaf == bare else f"{leaf} as {alias or bare}"
    if (module, bare) in NAMES:
        return NAMES[(module, bare)], name
    return module, name


def rewrite_imports(text: str) -> str:
    """`from distlab import runtime, compare` and `from distlab.cli import DTYPES, lesson_parser`: one statement
    per new home, in the order the names first appear."""

    def replace(match: re.Match) -> str:
        module, indent = match["module"], match["indent"]
        names = import_names(match["group"] if match["group"] is not None else match["line"])
        homes: dict[str, list[str]] = {}
        for name in names:
            home, name_there = new_home(module, name)
            homes.setdefault(home, []).append(name_there)
        if list(homes) == [module] and homes[module] == names:
            return match[0]
        # a trailing comment (`# noqa: E402` after a logging set-up) belongs to every statement the line became
        comment = match["comment"] or ""
        return "\n".join(import_statement(indent, home, group) + comment for home, group in homes.items())

    return FROM_IMPORT.sub(replace, text)


def rewrite_text(text: str) -> str:
    text = rewrite_imports(text)
    for pattern, new in DOTTED:
        text = pattern.sub(new, text)
    for pattern, new in PATHS:
        text = pattern.sub(new, text)
    return text


def rewrite_notebook(text: str) -> str:
    """The sources of a notebook's cells rewritten; outputs (what a past run printed) kept."""
    notebook = json.loads(text)
    changed = False
    for cell in notebook.get("cells", []):
        source = "".join(cell.get("source", []))
        new = rewrite_text(source)
        if new != source:
            cell["source"] = new.splitlines(keepends=True)
            changed = True
    if not changed:
        return text
    return json.dumps(notebook, indent=1, ensure_ascii=False) + "\n"


def tree_files(root: Path) -> list[Path]:
    """Every file of the tree: in a git checkout the tracked ones and the untracked ones git does not ignore
    (a local build's egg-info or an ignored scratch folder is not the tree), elsewhere every file below it."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root,
        capture_output=True,
        check=False,
    )
    if listed.returncode != 0:
        return sorted(root.rglob("*"))
    return sorted(root / name for name in listed.stdout.decode().split("\0") if name)


def text_files(root: Path):
    for path in tree_files(root):
        relative = path.relative_to(root).as_posix()
        if any(part in SKIP_DIRS for part in path.relative_to(root).parts) or not path.is_file():
            continue
        if relative in SELF or relative.startswith(RECORDS) or path.suffix not in TEXT_SUFFIXES:
            continue
        yield relative, path


def module_file(root: Path, module: str) -> Path:
    return root / "src" / (as_path(module) + ".py")


def moves(root: Path) -> list[tuple[Path, Path]]:
    """(old file, new file) for every mapped module still at its old path. A package moves file by file, so a
    file a late branch added to the old package follows the others into the new one."""
    found = []
    for old, new in MODULES.items():
        source, target = module_file(root, old), module_file(root, new)
        pairs = [(source, target)] if source.is_file() else []
        folder = root / "src" / as_path(old)
        if (folder / "__init__.py").is_file() or (folder.is_dir() and any(folder.rglob("*.py"))):
            pairs += [
                (path, root / "src" / as_path(new) / path.relative_to(folder))
                for path in sorted(folder.rglob("*"))
                if path.is_file() and "__pycache__" not in path.parts
            ]
        for source, target in pairs:
            if target.exists():
                if target.read_bytes() != source.read_bytes():
                    raise SystemExit(f"both {source} and {target} exist: merge them by hand, then run again")
            found.append((source, target))
    return found


def move(root: Path, source: Path, target: Path) -> None:
    """`git mv` (history follows) where the file is tracked, else a rename; a room's missing `__init__.py` is
    made from ROOMS; a copy already at the target (identical) is dropped; an emptied old folder is removed."""
    target.parent.mkdir(parents=True, exist_ok=True)
    package = target.parent.parent if target.name == "__init__.py" else target.parent  # a package's own moves
    while package != root / "src" / "distlab" and not (package / "__init__.py").exists():
        name = package.relative_to(root / "src").as_posix().replace("/", ".")
        (package / "__init__.py").write_text(f'"""{ROOMS.get(name, name)}"""\n')
        package = package.parent
    tracked = (
        subprocess.run(
            ["git", "ls-files", "--error-unmatch", str(source)], cwd=root, capture_output=True, check=False
        ).returncode
        == 0
    )
    if target.exists() and tracked:
        subprocess.run(["git", "rm", "-q", str(source)], cwd=root, check=True)
    elif target.exists():
        source.unlink()
    elif tracked:
        subprocess.run(["git", "mv", str(source), str(target)], cwd=root, check=True)
    else:
        source.rename(target)
    folder = source.parent
    while folder != root / "src" / "distlab" and folder.is_dir():
        for cache in folder.glob("__pycache__"):
            for path in cache.iterdir():
                path.unlink()
            cache.rmdir()
        if any(folder.iterdir()):
            break
        folder.rmdir()
        folder = folder.parent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent, help="the tree")
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if anything would change")
    args = parser.parse_args(argv)
    check_mapping()
    root = args.root.resolve()
    changes = []
    for source, target in moves(root):
        changes.append(f"moved {source.relative_to(root)} -> {target.relative_to(root)}")
        if not args.check:
            move(root, source, target)
    for relative, path in text_files(root):
        text = path.read_text()
        new = rewrite_notebook(text) if path.suffix == ".ipynb" else rewrite_text(text)
        if new != text:
            changes.append(f"rewrote {relative}")
            if not args.check:
                path.write_text(new)
    print("\n".join(changes) if changes else "nothing to move or rewrite: every path is in its room")
    if changes and not args.check:
        print("then: ruff check --fix --select I . && ruff format .   (imports re-sorted, long lines wrapped)")
    return 1 if args.check and changes else 0


if __name__ == "__main__":
    sys.exit(main())
