"""The lessons' command line: one spelling per flag, defaults in `--help`, each numeric flag's largest value a
lesson's memory allows, and bad values refused before any process group exists, in one line that names the flag.

For lessons (and their tests and benchmarks) only: the library never imports it (tests/test_layering.py). The
flag types, the rules that need the world size and the parser it builds on are `distlab.processes.flags`, which
any program may use with limits of its own (the planner's are `distlab.plan`'s). `lesson_parser(__doc__)` gives a
parser with `--device`, `--seed` and `--json`, checking `LIMITS`; `add_mlp_args` adds the layered-MLP flags of the
pipeline lessons (01-05), `--dtype` among the dtypes for which `distlab.proof.compare` states a tolerance.
"""

from __future__ import annotations

import argparse

from distlab.processes.flags import (
    FlagParser,
    add_global_batch,
    nonnegative_float,
    nonnegative_int,
    positive_float,
    positive_int,
    require,
    writable_file,
)
from distlab.processes.runtime import DEVICE_CHOICES
from distlab.proof.compare import DTYPES
from distlab.proof.models import MLP_IN, mlp_widths

# The largest value each numeric flag may take, and why: beyond it a value overflows (a seed past what
# every generator takes, with the offsets lessons add per rank and step) or cannot fit in a machine's memory
# (one width's float64 matrix, width^2 x 8 bytes, is 2 GiB at 2^14; a batch of 2^20 rows or a sequence of
# 2^16 tokens is more than any lesson here needs). Each flag is checked alone: a product of flags within
# their limits (--layers times --width^2) may still not fit, and then fails as PyTorch's out-of-memory error.
SEED_MAX = 2**31 - 1
WIDTHS = ("--width", "--dim", "--ffn-width", "--comm-dim", "--head-dim", "--input-features", "--vocab")
WIDTHS += ("--out-width", "--block")  # lessons 14-15: a layer's output width, an MX block
PARTS = ("--layers", "--heads", "--stages-per-rank", "--micro-batches", "--checkpoint-segments")
PARTS += ("--experts", "--top-k", "--dp", "--pp", "--tp", "--cp", "--approx-rank", "--fragments")
ROWS = ("--global-batch", "--comm-global-batch", "--train-size", "--dataset-size", "--held-out")
ROWS += ("--pairs-per-rank", "--memory-pairs", "--micro-batch-size", "--stream-chunk")
ROWS += ("--rows", "--cost-rows")  # lessons 14-15: rows of X; the rows the FP8 cost table prices
COUNTS = ("--steps", "--epochs", "--repeats", "--seeds", "--warmup", "--eval-every", "--checkpoint-every")
COUNTS += ("--accumulation-steps", "--train-steps", "--h", "--rounds")
SCALES = ("--lr", "--train-lr", "--tau", "--max-grad-norm", "--clip-norm", "--weight-decay")
SCALES += ("--capacity-factor", "--aux-weight", "--min-compression-rate")
SCALES += ("--outlier",)  # lesson 15: how much larger its outliers are
_GROUPS = (  # (flags, the largest value, why)
    (("--seed",), SEED_MAX, "a 31-bit seed: lessons add offsets per rank and step"),
    (WIDTHS, 2**14, "a width^2 float64 matrix is 2 GiB"),
    (PARTS, 2**14, "more than any model here holds"),
    (("--cost-global-batch",), 2**15, "its N x N float32 logits are 4 GiB at 2^15"),
    (("--seq-len",), 2**16, "a sequence beyond any lesson's memory"),
    (ROWS, 2**20, "rows beyond any batch a lesson holds in memory"),
    (COUNTS, 10**6, "days of running on this machine"),
    (("--message-mib", "--bucket-mib"), 2**16, "64 GiB, beyond a machine's memory"),
    (("--emulate-ms", "--link-ms-per-mib", "--link-ms"), 10**4, "10 s of emulated time per layer, message or MiB"),
    (SCALES, 10**6, "beyond any useful value"),
)
LIMITS: dict[str, tuple[int, str]] = {flag: (most, why) for flags, most, why in _GROUPS for flag in flags}


class LessonParser(FlagParser):
    """The lessons' parser: `FlagParser` with the lessons' `LIMITS`."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("limits", LIMITS)
        super().__init__(*args, **kwargs)


def lesson_parser(doc: str | None) -> LessonParser:
    """A parser whose description is the docstring's first paragraph, with the shared flags."""
    parser = add_runtime_args(LessonParser(description=(doc or "").split("\n\n")[0]))
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
    add_global_batch(parser, global_batch)
    add_optimizer_args(parser, steps, lr)
    parser.add_argument("--dtype", choices=DTYPES, default="float64", help="dtype of weights and data")
    return parser


def mlp_run(args: argparse.Namespace) -> dict:
    """The run `add_mlp_args`' flags describe (and `--micro-batches` where the lesson has it), as the plain
    values a pipeline's config takes: `PipelineConfig(**mlp_run(args), ...)`. The namespace stays here."""
    return {
        "widths": mlp_widths(args.layers, args.width),
        "global_batch": args.global_batch,
        "steps": args.steps,
        "lr": args.lr,
        "micro_batches": getattr(args, "micro_batches", 1),
        "seed": args.seed,
        "dtype": DTYPES[args.dtype],
    }


def add_emulate_args(
    parser: argparse.ArgumentParser, ms_per_layer: float, unit: str = "ms of wall time per layer per pass"
) -> argparse.ArgumentParser:
    """`--emulate-ms`: the emulated device's cost of one unit of work, a layer-pass unless the lesson names
    another (`distlab.proof.emulate`; 0: only the real CPU run)."""
    parser.add_argument(
        "--emulate-ms",
        type=nonnegative_float,
        default=ms_per_layer,
        help=f"emulated device: {unit}, slept, not computed (0: skip the emulated run)",
    )
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
    add_global_batch(parser, global_batch)
    parser.add_argument("--tau", type=positive_float, default=tau, help="temperature tau (logit scale s = 1/tau)")
    return parser


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
