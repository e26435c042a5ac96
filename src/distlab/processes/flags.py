"""Flags and their rules, for any command line of distlab: the argument types, the checks that need the world
size, and a parser said once under torchrun. No limit of any one program lives here.

The argument types reject zero, negatives, NaN and non-numbers with the flag's name ("argument --width:
expected a positive integer, got '0'"). Checks that need the world size P are made before any process group
exists (P is torchrun's `WORLD_SIZE`), raise ValueError the same way on every rank before any collective, and
name the flag: `require(ok, "--flag", message)`, and the one "P divides N" rule, `p_divides_n`, in one wording.

`FlagParser` is argparse that rank 0 alone prints, with one-line errors, and a table of the largest value each
numeric flag may take (`limits`: flag -> (largest value, why)): each program states its own. The lessons'
parser (`distlab.proof.cli`, for lessons only: the library never imports it) holds the limits a lesson's
memory sets; the planner, which builds no tensor, holds its own.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

GLOBAL_BATCH_HELP = "global batch N: samples per step (rows, sequences or pairs) over all P ranks"


def _number(kind: type, accept: Callable[[float], bool], what: str) -> Callable[[str], float]:
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or (isinstance(value, float) and not math.isfinite(value)) or not accept(value):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    parse.__name__ = what
    return parse


positive_int = _number(int, lambda v: v > 0, "a positive integer")
nonnegative_int = _number(int, lambda v: v >= 0, "an integer >= 0")
positive_float = _number(float, lambda v: v > 0, "a positive finite number")
nonnegative_float = _number(float, lambda v: v >= 0, "a finite number >= 0")
fraction = _number(float, lambda v: 0 <= v < 1, "a number in [0, 1)")
share = _number(float, lambda v: 0 < v <= 1, "a share 0 < x <= 1")  # of a peak: zero does nothing, one is the peak


def writable_file(text: str) -> str:
    """A file the run will write at its end (--json): refused now if it could not be written then."""
    path = Path(text)
    folder = path.parent
    if text.endswith(os.sep) or path.is_dir():  # "out/" names a directory even before it exists
        raise argparse.ArgumentTypeError(f"{text!r} is a directory; give a file name")
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"the directory of {text!r}, {str(folder)!r}, does not exist")
    if not os.access(folder, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise argparse.ArgumentTypeError(f"{text!r} cannot be written (permissions)")
    return text


def png_file(text: str) -> str:
    """A picture written at the end (--plot): a writable file whose name ends in .png (no name is changed)."""
    text = writable_file(text)
    if not text.lower().endswith(".png"):
        raise argparse.ArgumentTypeError(f"{text!r}: the plot is a PNG; give a name ending in .png")
    return text


def writable_dir(text: str) -> str:
    """A directory the run writes into (--checkpoint-dir), made if missing: refused now, not at the first save."""
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} exists and is not a directory")
    existing = next(p for p in (path, *path.absolute().parents) if p.exists())
    if not existing.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} cannot be made: {str(existing)!r} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{text!r} cannot be written or made ({str(existing)!r}: permissions)")
    return text


def checkpoint_dir(text: str) -> str:
    """A distributed checkpoint's folder (lessons 07 and 12): writable as `writable_dir`, its parent writable too
    (the save is staged beside it, `distlab.processes.committed`), and holding nothing but a checkpoint (a save
    replaces it whole: a folder of other files is not one to replace)."""
    from distlab.processes.committed import holds_only_checkpoint  # (torch.distributed, only when asked)

    writable_dir(text)
    path = Path(text).absolute()
    if not holds_only_checkpoint(path):
        raise argparse.ArgumentTypeError(
            f"{text!r} holds files that are not a checkpoint's: give an empty or new folder"
        )
    existing = next(p for p in path.parents if p.exists())
    if not os.access(existing, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(
            f"{text!r}: its parent {str(existing)!r} cannot be written (a save is staged there)"
        )
    return text


def add_global_batch(parser: argparse.ArgumentParser, default: int) -> argparse.ArgumentParser:
    """`--global-batch`, declared once for every program: N, `args.global_batch` in code."""
    parser.add_argument("--global-batch", type=positive_int, default=default, help=GLOBAL_BATCH_HELP)
    return parser


def over_limit(
    parser: argparse.ArgumentParser, args: argparse.Namespace, limits: Mapping[str, tuple[int, str]]
) -> str | None:
    """The first numeric flag of `args` above its `limits` entry, as one line naming it; None if none is."""
    for action in parser._actions:  # noqa: SLF001 - argparse's list of the flags it knows
        flag = next((f for f in action.option_strings if f in limits), None)
        value = getattr(args, action.dest, None)
        if flag is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        most, why = limits[flag]
        if value > most:
            shown = f"{value:,}" if isinstance(value, int) and value < 10**30 else f"{value:.3g}"
            return f"argument {flag}: at most {most:,} ({why}), got {shown}"
    return None


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown after every help text; the description keeps its line breaks."""


class FlagParser(argparse.ArgumentParser):
    """argparse, said once under torchrun: rank 0 prints `--help` and errors, every rank exits alike; every
    numeric flag checked against `limits` (flag -> (largest value, why)), the program's own."""

    def __init__(self, *args, limits: Mapping[str, tuple[int, str]] | None = None, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)
        self.limits = dict(limits or {})

    def error(self, message: str):  # one line, not usage + error
        self._print_message(f"{self.prog}: error: {message}\n", sys.stderr)
        sys.exit(2)

    def parse_known_args(self, args=None, namespace=None):
        """argparse's, then every numeric flag against its `limits` entry (one line naming the flag)."""
        parsed, rest = super().parse_known_args(args, namespace)
        if (problem := over_limit(self, parsed, self.limits)) is not None:
            self.error(problem)
        return parsed, rest

    def _print_message(self, message: str, file=None) -> None:  # --help, usage: rank 0 only
        if os.environ.get("RANK", "0") == "0":
            super()._print_message(message, file)


def require(ok: bool, flag: str, message: str) -> None:
    """A check that needs the world size: the same ValueError on every rank, naming the flag."""
    if not ok:
        raise ValueError(f"{flag}: {message}")


def p_divides_n(n: int, world_size: int, flag: str = "--global-batch") -> None:
    """The one "P divides N" rule, in one wording: every rank holds C = N / P whole samples."""
    require(n % world_size == 0, flag, f"P = {world_size} ranks must divide N = {n}")


def divides_global_batch(args: argparse.Namespace, world_size: int, flag: str = "--global-batch") -> None:
    """`p_divides_n` for the global batch a parsed `flag` gives (a rule for `check_flags_against_world`)."""
    p_divides_n(getattr(args, flag.removeprefix("--").replace("-", "_")), world_size, flag)


def launched_world_size() -> int | None:
    """P as torchrun announces it to every rank (WORLD_SIZE), before any process group exists; None
    when the script was not started by torchrun (then `distributed()` says how to start it)."""
    value = os.environ.get("WORLD_SIZE")
    return int(value) if value else None


def check_flags_against_world(
    args: argparse.Namespace, rules: Callable[[argparse.Namespace, int], None]
) -> argparse.Namespace:
    """Every flag check that depends on the world size P, run first: the step each lesson's `main()`
    takes right after `parse_args()`, before `distributed()` and before it prints anything.

    `rules(args, P)` states the lesson's rules with `require(ok, "--flag", message)` (P divides N,
    P <= layers, B <= C, ...). The first rule broken raises ValueError the same way on every rank;
    `run_main` prints it once as `error: --flag: message` and exits 2, so a learner reads one line
    naming the flag, not pages of output first. Outside torchrun (no P yet) the rules wait: the caller
    runs them again with `rt.world_size` if it wants, and `distributed()` explains how to launch.

        args = check_flags_against_world(parse_args(), world_rules)
        with distributed(args.device) as rt: ...
    """
    world_size = launched_world_size()
    if world_size is not None:
        rules(args, world_size)
    return args
