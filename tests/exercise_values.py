"""What the names on an answer's raising line held (`exercise_ranks._rank`): when an answer raises, the deepest
frame in the answer's file, its raising statement parsed (the whole of a call written over several lines; an
audit's planted slip read as it was compiled), and each name and attribute chain on it (`param.grad`,
`rt.world_size`, `pieces[0]`) described from that frame: a tensor by dtype, shape and graph, None as None, a
number or a short list, tuple or dict keys as themselves. Nothing is called: an attribute is read only where
it is a plain one (an instance's own, a module's, a C slot such as a tensor's `.grad`), never a Python property,
so the description can run no collective; and it never raises (a value it cannot read is left out)."""

from __future__ import annotations

import ast
import inspect
import linecache
import traceback
import types
import warnings
from pathlib import Path
from typing import Any

import torch

VALUES = "values at that line: "
RETURNED = "the answer's last call returned: "
LIMIT = 200  # characters of values at most
SKIP = object()  # a name or attribute the describer will not read


def _attr(obj: Any, name: str) -> Any:
    """`obj.name` where reading it runs no Python code of the answer's or the judge's: else SKIP."""
    try:
        static = inspect.getattr_static(obj, name)
    except AttributeError:
        if isinstance(obj, torch.nn.Module):  # a parameter, buffer or submodule: nn.Module.__getattr__'s dicts
            for kept in ("_parameters", "_buffers", "_modules"):
                if name in obj.__dict__.get(kept, {}):
                    return obj.__dict__[kept][name]
        return SKIP
    if isinstance(obj, types.ModuleType) or isinstance(
        static, (types.GetSetDescriptorType, types.MemberDescriptorType)
    ):
        return getattr(obj, name)
    if hasattr(type(static), "__get__"):  # a property, a method, any other descriptor: not read
        return SKIP
    return static


def _value(node: ast.AST, scope: dict) -> Any:
    """The value of a Name, an Attribute chain or a constant-index subscript of a list, tuple or dict, or SKIP."""
    if isinstance(node, ast.Name):
        return scope.get(node.id, SKIP)
    if isinstance(node, ast.Attribute):
        base = _value(node.value, scope)
        return SKIP if base is SKIP else _attr(base, node.attr)
    if isinstance(node, ast.Subscript):
        base, index = _value(node.value, scope), node.slice
        key = index.value if isinstance(index, ast.Constant) else _value(index, scope)
        if type(base) in (list, tuple) and type(key) is int and -len(base) <= key < len(base):
            return base[key]
        if type(base) is dict and type(key) in (int, str) and key in base:
            return base[key]
    return SKIP


def _rounded(value: Any) -> Any:
    """A tensor's values (`tolist`) with its floats to four significant digits."""
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    return float(f"{value:.4g}") if isinstance(value, float) else value


def _tensor(t: torch.Tensor) -> str:
    """dtype, shape and graph; a plain tensor of at most six elements with its values."""
    dtype = str(t.dtype).removeprefix("torch.")
    text = f"{dtype} {list(t.shape)}"
    if type(t) is torch.Tensor and t.numel() <= 6 and t.device.type != "meta":
        text += f" = {_rounded(t.detach().tolist())}"
    if not (t.is_floating_point() or t.is_complex()):  # an integer tensor carries no graph
        return text
    if t.grad_fn is not None:
        return f"{text}, carries a graph (grad_fn {type(t.grad_fn).__name__})"
    if t.requires_grad:
        return f"{text}, requires grad"
    return f"{text}, requires_grad False" if isinstance(t, torch.nn.Parameter) else f"{text}, no graph"


def _short(value: Any) -> str | None:
    """The words for one value, or None for what is not told (a module, a function, an object)."""
    if isinstance(value, torch.Tensor):
        return _tensor(value)
    if value is None or type(value) in (bool, int, float, torch.dtype, torch.Size):
        return repr(value)
    if type(value) is str:
        return repr(value[:30])
    if type(value) in (list, tuple):
        if value and all(isinstance(v, torch.Tensor) for v in value):
            shapes = ", ".join(str(list(v.shape)) for v in value[:4]) + (", ..." if len(value) > 4 else "")
            return f"{type(value).__name__} of {len(value)} tensor{'s' * (len(value) > 1)}, shapes {shapes}"
        text = repr(value)
        return text if len(text) <= 60 else text[:57] + "..."
    if type(value) is dict:
        keys = repr(list(value)[:8]) + (" ..." if len(value) > 8 else "")
        return f"dict, keys {keys}"
    return None


def _line(roots: list[ast.AST], scope: dict) -> list[str]:
    """Each name and chain in the raising statement, in order of appearance, described once."""
    chains = [n for r in roots for n in ast.walk(r) if isinstance(n, (ast.Name, ast.Attribute, ast.Subscript))]
    chains.sort(key=lambda n: (n.lineno, n.col_offset, -n.end_col_offset))
    said, seen = [], set()
    for chain in chains:
        text = ast.unparse(chain)
        if text in seen:
            continue
        seen.add(text)
        root = chain
        while isinstance(root, (ast.Attribute, ast.Subscript)):
            root = root.value
        if isinstance(root, ast.Name) and isinstance(scope.get(root.id), types.ModuleType):
            continue  # a module's constant (torch.float32): the line says it already
        value = _value(chain, scope)
        words = None if value is SKIP else _short(value)
        if words is not None:
            said.append(
                f"{text} = {words}" if value is None or not isinstance(value, torch.Tensor) else f"{text}: {words}"
            )
    return said


def _statement(lines: list[str], lineno: int) -> list[ast.AST]:
    """The innermost statement spanning `lineno` in the file (a call written over several lines whole); of a
    block's head (`for p in params:`, `if x:`) only the head, not its body."""
    try:
        tree = ast.parse("".join(lines))
    except SyntaxError:
        return []
    spans = [n for n in ast.walk(tree) if isinstance(n, ast.stmt) and n.lineno <= lineno <= n.end_lineno]
    if not spans:
        return []
    node = max(spans, key=lambda n: (n.lineno, -n.end_lineno))
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return []
    body = ("body", "orelse", "finalbody", "handlers", "cases")
    head = [v for field, v in ast.iter_fields(node) if field not in body]
    return [n for v in head for n in (v if isinstance(v, list) else [v]) if isinstance(n, ast.AST)]


def _parsed(source: str) -> ast.AST | None:
    """The line as Python: as it is, or as a block's head (`for p in params:`) or a continued call's start."""
    for text in (source, source + " pass", source + ")", source + "))", source + "]"):
        try:
            return ast.parse(text)
        except SyntaxError:
            continue
    return None


def values(err: BaseException, path: Path) -> str:
    """The names on the answer's raising line (the deepest frame in `path`) and their values, in one short line;
    empty when the answer's file is not on the traceback or nothing on its line can be told."""
    try:
        frames = [(f, n) for f, n in traceback.walk_tb(err.__traceback__) if Path(f.f_code.co_filename) == path]
        if not frames:
            return ""
        frame, lineno = frames[-1]
        planted = frame.f_globals.get("__planted_lines__")  # an audit's slip: the source as compiled
        if planted is not None:  # this child's traceback shows it too (the rank's process ends with this raise)
            linecache.cache[str(path)] = (sum(map(len, planted)), None, planted, str(path))
        roots = _statement(linecache.getlines(str(path)), lineno)
        if not roots:
            tree = _parsed(linecache.getline(str(path), lineno).strip())
            roots = [] if tree is None else [tree]
        scope = {**frame.f_globals, **frame.f_locals}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a non-leaf's .grad read warns
            said = _line(roots, scope)
        text = "; ".join(said)
        return text if len(text) <= LIMIT else text[: LIMIT - 3] + "..."
    except Exception:  # the describer never raises: a value it cannot read is left out
        return ""


def _returned(value: Any) -> str:
    """What an answer returned, each element of a tuple told alone (an object by its type's name)."""
    if type(value) is not tuple:
        return _short(value) or type(value).__name__
    return "(" + ", ".join(_short(v) or type(v).__name__ for v in value[:4]) + (", ...)" if len(value) > 4 else ")")


def noted(err: BaseException, path: Path, returned: Any = SKIP) -> None:
    """`err` with a note of the values on the answer's raising line, which its traceback (the child's, sent to
    the parent) prints after the error's last line: `exercise_ranks._raised` tells it after the "at" line. A
    raise outside the answer's file (the judge back-propagating the answer's loss) is told by what the answer's
    last call `returned`, where it returned."""
    try:
        text = values(err, path)
        if text:
            err.add_note(VALUES + text)
        elif returned is not SKIP and not any(
            Path(f.f_code.co_filename) == path for f, _ in traceback.walk_tb(err.__traceback__)
        ):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                said = _returned(returned)
            err.add_note(RETURNED + (said if len(said) <= LIMIT else said[: LIMIT - 3] + "..."))
    except Exception:  # the note is never the failure
        pass
