"""The planner's own flag types and limits. A planner builds no tensor, so the lessons' memory limits
(`distlab.cli`: a width^2 float64 matrix is 2 GiB) do not apply here; each limit below is a typo guard, with
its reason, far above every published run. Nothing here imports the lessons' parser (these small types are
written again here on purpose, until the ground floor has a home for flag types that carry no limits).

A bad value is refused by the parser in one line naming the flag (`PlanParser.error`, exit 2), before any
search: a path to write (--json, --plot) is checked when parsed, not after the search.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

# flag: (the most it takes, why)
LIMITS: dict[str, tuple[int, str]] = {
    "--layers": (4096, "blocks; the largest published models have 126 (Llama 3 405B)"),
    "--dim": (1 << 18, "width d; published models stay under 32,768"),
    "--heads": (1 << 14, "heads; published models have at most 128"),
    "--kv-heads": (1 << 14, "key/value heads, at most --heads"),
    "--head-dim": (1 << 12, "d_h; published models use 64-256"),
    "--ffn-width": (1 << 20, "d_ff; published dense models stay under 65,536"),
    "--vocab": (1 << 24, "vocabulary; published tokenizers hold at most 262,144 tokens"),
    "--experts": (1 << 16, "routed experts; published mixtures have at most 256"),
    "--top-k": (1 << 10, "experts per token"),
    "--expert-ffn-width": (1 << 20, "an expert's width"),
    "--shared-experts": (1 << 10, "always-on experts"),
    "--dense-layers": (4096, "dense blocks before the experts, at most --layers"),
    "--q-rank": (1 << 18, "MLA's query latent"),
    "--kv-rank": (1 << 18, "MLA's key/value latent"),
    "--rope-dim": (1 << 12, "MLA's rotary part per head"),
    "--gpus": (1 << 22, "GPUs; the largest published runs use tens of thousands"),
    "--nodes": (1 << 19, "nodes"),
    "--global-batch": (1 << 26, "sequences per step"),
    "--seq-len": (1 << 24, "tokens per sequence (16 M; published contexts reach 1 M)"),
    "--micro-batch": (1 << 16, "sequences per micro-batch"),
    "--stages-per-rank": (64, "pipeline stages per rank, v"),
    "--top": (10_000, "configurations shown"),
}


class PlanParser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage block), and every integer flag held to its LIMITS entry."""

    def error(self, message: str):
        self._print_message(f"{self.prog}: error: {message}\n", sys.stderr)
        sys.exit(2)

    def parse_known_args(self, args=None, namespace=None):
        parsed, rest = super().parse_known_args(args, namespace)
        for action in self._actions:
            flag = next((f for f in action.option_strings if f in LIMITS), None)
            value = getattr(parsed, action.dest, None) if flag else None
            if isinstance(value, int) and value > LIMITS[flag][0]:
                most, why = LIMITS[flag]
                self.error(f"argument {flag}: at most {most:,} ({why}), got {value:,}")
        return parsed, rest


def positive_int(text: str) -> int:
    """An integer >= 1 (written again here, not taken from the lessons' parser: see the module docstring)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def count(text: str) -> int:
    """An integer >= 0 (0: none, as in --shared-experts 0)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def efficiency(text: str) -> float:
    """A share of a peak: 0 < x <= 1. Zero is refused (a device that does nothing), one allowed (the peak)."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a share 0 < x <= 1, got {text!r}")
    return value


def gib(text: str) -> float:
    """A size in GiB, >= 0."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected GiB >= 0, got {text!r}")
    return value


def writable_file(text: str) -> str:
    """A file written at the end (--json): refused now if it could not be written then."""
    path = Path(text)
    if text.endswith(os.sep) or path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a directory; give a file name")
    folder = path.parent
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
