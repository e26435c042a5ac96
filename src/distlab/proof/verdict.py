"""The end of every lesson: its claims, checked by name, agreed on by every rank, and an exit code.

A lesson makes its checks as it goes (`verdict.check("gradients equal the unsplit model's", ok)`) and
records the figures it reports (`verdict.figure("bubble", 0.111)`). `finish()` reduces every check
across ranks in one all_reduce(MIN) on the group's device, so a claim that fails on any rank fails on
all of them and every rank exits with the same code; it prints one line per check and the verdict,
and writes the checks and figures as JSON on rank 0 when asked (`--json PATH`).

Every rank must make the same checks in the same order (they are the lesson's claims, not a rank's).
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from distlab.processes.console import print0
from distlab.processes.identity import Runtime


@dataclass
class Check:
    name: str
    ok: bool
    detail: str = ""


@dataclass
class Verdict:
    rt: Runtime
    checks: list[Check] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        """Record a named claim and whether it held on this rank; returns `ok`."""
        self.checks.append(Check(name, bool(ok), detail))
        return bool(ok)

    def figure(self, key: str, value: Any) -> Any:
        """Record a figure for the JSON report; returns `value`."""
        self.figures[key] = value
        return value

    def agreed(self) -> list[bool]:
        """Each check, true only if it held on every rank (one collective on the group's device)."""
        flags = torch.tensor([c.ok for c in self.checks] or [True], dtype=torch.int32, device=self.rt.device)
        if dist.is_initialized():
            dist.all_reduce(flags, op=dist.ReduceOp.MIN)
        return [bool(v) for v in flags.tolist()][: len(self.checks)]

    def finish(self, json_path: str | None = None) -> int:
        """Print every check and the verdict; write JSON on rank 0; return the exit code (0 = PASS)."""
        agreed = self.agreed()
        print0()
        for check, ok in zip(self.checks, agreed):
            mark = "[green]PASS[/]" if ok else "[bold red]FAIL[/]"
            print0(f"{mark}  {check.name}" + (f": {check.detail}" if check.detail else ""), highlight=False)
        passed = all(agreed)
        failed = len(agreed) - sum(agreed)
        print0(
            "[bold green]PASS[/]: every claim holds"
            if passed
            else f"[bold red]FAIL[/]: {failed} of {len(agreed)} claims do not hold"
        )
        if json_path and self.rt.is_first:
            report = {
                "lesson": Path(sys.argv[0]).stem,
                "world_size": self.rt.world_size,
                "passed": passed,
                "checks": [{"name": c.name, "ok": ok, "detail": c.detail} for c, ok in zip(self.checks, agreed)],
                "figures": _plain(self.figures),
            }
            Path(json_path).write_text(json.dumps(report, indent=1))
        return 0 if passed else 1


def _plain(value: Any) -> Any:
    """JSON-ready copy: tensors become numbers or lists, non-finite floats become strings."""
    if isinstance(value, torch.Tensor):
        value = value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value
