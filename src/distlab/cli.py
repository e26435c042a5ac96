"""The command line every lesson shares: one spelling per flag, defaults in `--help`, and bad values
refused before any process group exists, in one line that names the flag the learner typed.

`lesson_parser(__doc__)` gives a parser with `--device`, `--seed` and `--json`; the argument types
below reject zero, negatives, NaN and non-numbers with the flag's name ("argument --width: expected a
positive integer, got '0'"). Checks that need the world size (P divides N, ...) are made after the
group exists, raise ValueError the same way on every rank before any collective, and name the flag too.
`DTYPES` names the dtypes for which `distlab.compare` states a tolerance: a lesson offers no dtype it
could not check. `add_mlp_args` adds the layered-MLP flags of the pipeline lessons (01-05).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path

from distlab.compare import TOLERANCES
from distlab.runtime import DEVICE_CHOICES

DTYPES = {str(dtype).removeprefix("torch."): dtype for dtype in TOLERANCES}
MLP_IN, MLP_OUT = 16, 8


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


# The largest value each numeric flag may take, and why: beyond it a value overflows (a seed past what
# every generator takes, with the offsets lessons add per rank and step) or cannot fit in a machine's memory
# (one width's float64 matrix, width^2 x 8 bytes, is 2 GiB at 2^14; a batch of 2^20 rows or a sequence of
# 2^16 tokens is more than any lesson here needs). Each flag is checked alone: a product of flags within
# their limits (--layers times --width^2) may still not fit, and then fails as PyTorch's out-of-memory error.
SEED_MAX = 2**31 - 1
WIDTHS = ("--width", "--dim", "--ffn-width", "--comm-dim", "--head-dim", "--input-features", "--vocab")
PARTS = ("--layers", "--heads", "--stages-per-rank", "--micro-batches", "--checkpoint-segments")
PARTS += ("--experts", "--top-k", "--dp", "--pp", "--tp", "--cp", "--fragments")
ROWS = ("--global-batch", "--comm-global-batch", "--train-size", "--dataset-size", "--held-out")
ROWS += ("--pairs-per-rank", "--memory-pairs", "--micro-batch-size", "--stream-chunk")
COUNTS = ("--steps", "--epochs", "--repeats", "--seeds", "--warmup", "--eval-every", "--checkpoint-every")
COUNTS += ("--accumulation-steps", "--train-steps", "--h", "--rounds")
SCALES = ("--lr", "--train-lr", "--tau", "--max-grad-norm", "--clip-norm", "--weight-decay")
SCALES += ("--capacity-factor", "--aux-weight")
_GROUPS = (  # (flags, the largest value, why)
    (("--seed",), SEED_MAX, "a 31-bit seed: lessons add offsets per rank and step"),
    (WIDTHS, 2**14, "a width^2 float64 matrix is 2 GiB"),
    (PARTS, 2**14, "more than any model here holds"),
    (("--cost-global-batch",), 2**15, "its N x N float32 logits are 4 GiB at 2^15"),
    (("--seq-len",), 2**16, "a sequence beyond any lesson's memory"),
    (ROWS, 2**20, "rows beyond any batch a lesson holds in memory"),
    (COUNTS, 10**6, "days of running on this machine"),
    (("--message-mib", "--bucket-mib"), 2**16, "64 GiB, beyond a machine's memory"),
    (("--emulate-ms", "--link-ms-per-mib"), 10**4, "10 s of emulated time per layer or MiB"),
    (SCALES, 10**6, "beyond any useful value"),
)
LIMITS: dict[str, tuple[int, str]] = {flag: (most, why) for flags, most, why in _GROUPS for flag in flags}


def over_limit(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str | None:
    """The first numeric flag of `args` above its LIMITS entry, as one line naming it; None if none is."""
    for action in parser._actions:  # noqa: SLF001 - argparse's list of the flags it knows
        flag = next((f for f in action.option_strings if f in LIMITS), None)
        value = getattr(args, action.dest, None)
        if flag is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        most, why = LIMITS[flag]
        if value > most:
            shown = f"{value:,}" if isinstance(value, int) and value < 10**30 else f"{value:.3g}"
            return f"argument {flag}: at most {most:,} ({why}), got {shown}"
    return None


def writable_file(text: str) -> str:
    """A file the run will write at its end (--json): refused now if it could not be written then."""
    path = Path(text)
    folder = path.parent
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a directory; give a file name")
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"the directory of {text!r}, {str(folder)!r}, does not exist")
    if not os.access(folder, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise argparse.ArgumentTypeError(f"{text!r} cannot be written (permissions)")
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


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown after every help text; the description keeps its line breaks."""


class LessonParser(argparse.ArgumentParser):
    """argparse, said once under torchrun: rank 0 prints `--help` and errors, every rank exits alike."""

    def error(self, message: str):  # one line, not usage + error
        self._print_message(f"{self.prog}: error: {message}\n", sys.stderr)
        sys.exit(2)

    def parse_known_args(self, args=None, namespace=None):
        """argparse's, then every numeric flag against its LIMITS entry (one line naming the flag)."""
        parsed, rest = super().parse_known_args(args, namespace)
        if (problem := over_limit(self, parsed)) is not None:
            self.error(problem)
        return parsed, rest

    def _print_message(self, message: str, file=None) -> None:  # --help, usage: rank 0 only
        if os.environ.get("RANK", "0") == "0":
            super()._print_message(message, file)


def lesson_parser(doc: str | None) -> LessonParser:
    """A parser whose description is the docstring's first paragraph, with the shared flags."""
    parser = add_runtime_args(LessonParser(description=(doc or "").split("\n\n")[0], formatter_class=_Formatter))
    parser.add_argument(
        "--json", metavar="PATH", type=writable_file, help="write the checks and figures here as JSON (rank 0)"
    )
    return parser


def add_runtime_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags every lesson shares (for parsers not made by `lesson_parser`)."""
    parser.add_argument(
        "--device",
        choices=DEVICE_CHOICES,
        default="auto",
        help="auto: nccl + one GPU per rank when the node has enough GPUs, else gloo + CPU",
    )
    parser.add_argument("--seed", type=nonnegative_int, default=0, help="seed of weights and data")
    return parser


def add_mlp_args(
    parser: argparse.ArgumentParser, layers: int, width: int, global_batch: int, steps: int, lr: float = 0.1
) -> argparse.ArgumentParser:
    """The layered-MLP flags of the pipeline lessons."""
    parser.add_argument(
        "--layers", type=positive_int, default=layers, help="layers of the MLP (a pipeline needs P <= layers)"
    )
    parser.add_argument("--width", type=positive_int, default=width, help="hidden width")
    parser.add_argument("--global-batch", type=positive_int, default=global_batch, help="rows per step, N")
    add_optimizer_args(parser, steps, lr)
    parser.add_argument("--dtype", choices=DTYPES, default="float64", help="dtype of weights and data")
    return parser


def add_optimizer_args(
    parser: argparse.ArgumentParser, steps: int, lr: float, optimizer: str = "SGD"
) -> argparse.ArgumentParser:
    """--steps and --lr, the two flags every training lesson has (the optimizer named in the help)."""
    parser.add_argument("--steps", type=positive_int, default=steps, help=f"{optimizer} steps")
    parser.add_argument("--lr", type=positive_float, default=lr, help=f"{optimizer} learning rate")
    return parser


def add_contrastive_args(
    parser: argparse.ArgumentParser, global_batch: int, tau: float = 0.1
) -> argparse.ArgumentParser:
    """The flags of every contrastive lesson with a fixed temperature: N and tau."""
    parser.add_argument(
        "--global-batch", type=positive_int, default=global_batch, help="pairs per step, N (P must divide it)"
    )
    parser.add_argument("--tau", type=positive_float, default=tau, help="temperature tau (logit scale s = 1/tau)")
    return parser


def mlp_widths(args: argparse.Namespace) -> tuple[int, ...]:
    return (MLP_IN, *[args.width] * (args.layers - 1), MLP_OUT)


def require(ok: bool, flag: str, message: str) -> None:
    """A check that needs the world size: the same ValueError on every rank, naming the flag."""
    if not ok:
        raise ValueError(f"{flag}: {message}")


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


def divides_global_batch(args: argparse.Namespace, world_size: int, flag: str = "--global-batch") -> None:
    """The commonest rule: P divides the global batch N given by `flag`."""
    n = getattr(args, flag.removeprefix("--").replace("-", "_"))
    require(n % world_size == 0, flag, f"P = {world_size} ranks must divide N = {n}")


def check_mlp_input(args: argparse.Namespace, world_size: int | None = None) -> None:
    """`--input-features` against the layered MLP's first layer (MLP_IN features per row): the "does
    not fit" error lesson 01 demonstrates, as one line naming the flag before any output. Usable as a
    rule of `check_flags_against_world` (it ignores P)."""
    require(
        args.input_features == MLP_IN,
        "--input-features",
        f"a batch of shape (N, {args.input_features}) does not fit the model: its first layer takes "
        f"{MLP_IN} features per row",
    )


def stages_fit_layers(args: argparse.Namespace, world_size: int) -> None:
    """The pipeline lessons' rule (01-05): P v stages, each at least one of the --layers layers; and,
    where the lesson has the flag, --input-features fitting the MLP's first layer."""
    if hasattr(args, "input_features"):
        check_mlp_input(args)
    v = getattr(args, "stages_per_rank", 1)
    require(
        world_size * v <= args.layers,
        "--layers",
        f"{world_size * v} stages (P = {world_size} ranks x v = {v}) need at least {world_size * v} layers, "
        f"got {args.layers}: every stage computes at least one layer",
    )
