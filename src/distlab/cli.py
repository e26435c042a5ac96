"""The command-line flags lessons share, so every lesson spells them, and their defaults, one way.

`DTYPES` names the dtypes for which `distlab.compare` states a tolerance: a lesson offers no dtype it
could not check. `add_mlp_args` adds the layered-MLP flags of the model-parallel and pipeline lessons
(01-04); `mlp_widths` turns them into `layered_mlp` widths (16 features in, 8 out).
"""

from __future__ import annotations

import argparse

from distlab.compare import TOLERANCES

DTYPES = {str(dtype).removeprefix("torch."): dtype for dtype in TOLERANCES}
MLP_IN, MLP_OUT = 16, 8


def add_mlp_args(parser: argparse.ArgumentParser, layers: int, width: int, batch_size: int,
                 steps: int, lr: float = 0.1) -> argparse.ArgumentParser:
    parser.add_argument("--layers", type=int, default=layers, help="layers of the MLP (P <= layers)")
    parser.add_argument("--width", type=int, default=width, help="hidden width")
    parser.add_argument("--batch-size", type=int, default=batch_size)
    parser.add_argument("--steps", type=int, default=steps, help="SGD steps")
    parser.add_argument("--lr", type=float, default=lr)
    parser.add_argument("--dtype", choices=DTYPES, default="float64")
    return parser


def mlp_widths(args: argparse.Namespace) -> tuple[int, ...]:
    return (MLP_IN, *[args.width] * (args.layers - 1), MLP_OUT)
