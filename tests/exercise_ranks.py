"""What each rank runs when the exercises' judge judges answers (`exercise_kit`): the answers one after another
through the exercise's body, every claim agreed across ranks before the body goes on (so a slip that leaves some
ranks right stops every rank at once, a verdict naming them, never one rank left waiting in a collective), every
collective an answer runs recorded in words (`exercise_watch.Ran`: what each rank sent, to whom, on which group),
and a failed run told in a few lines: the answer's own line that raised and the values of the names on it
(`exercise_values`; for a process killed in C++, gloo's or c10's abort, the error it wrote on its stderr, kept
while each answer runs), or, for a transport error (a peer's connection closed, a collective timed out), that the
ranks stopped running the same collectives and what each rank's answer ran until then, never the fault of the
rank that happened to see it. Each call of an answer is shadowed by the lesson's own function (`exercise_trace`),
so that a verdict can say where the answer first departs from it."""

from __future__ import annotations

import contextlib
import functools
import inspect
import linecache
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from exercise_claims import Claims
from exercise_trace import DEPARTS, Shadow
from exercise_values import RETURNED, SKIP, VALUES, noted
from exercise_watch import Ran, ran_text, unknown_ops
from torch.utils._python_dispatch import _disable_current_modes

from distlab.processes.spawn import SpawnError

UNKNOWN_CLAIM = "every collective the answer runs is one the judge can price"


TRANSPORT = re.compile(r"Connection closed by peer|Connection reset by peer|Broken pipe|Timed out|timed out|timeout")


def _ran_by_rank(logs: str | None, k: int, world: int) -> str:
    """What each rank's answer ran before the failure (the `Ran` logs of answer k), one clause per rank."""
    if logs is None:
        return ""
    each = []
    for r in range(world):
        path = Path(logs) / f"{k}-{r}"
        calls = path.read_text().splitlines() if path.exists() else []
        each.append(f"rank {r}: {ran_text(calls)}")
    return "\n  what each rank's answer ran: " + "; ".join(each)


def _raised(err: Exception, answer, ran: str = "", logs: str | None = None) -> str:
    """One rank's failure in a few lines: the error's last line, on which rank, and the answer's own line
    that raised it (the deepest frame in the answer's file), never the judge's traceback. A transport error
    (a peer's connection closed, a collective timed out) is not that rank's fault: it says the ranks stopped
    running the same collectives, and `ran` (what each rank's answer ran) shows where they parted. A process
    that died without a traceback (a C++ abort inside gloo or c10) is told by the error it wrote on its stderr
    (kept under `logs` by `_rank`), not by the last line of its crash dump."""
    if not isinstance(err, SpawnError):  # a rank that never finished: a collective left waiting
        return f"your answer did not finish: {err} (a collective some rank never joined?){ran}"
    notes = (VALUES, RETURNED, DEPARTS)  # `exercise_values.noted`'s and `_rank`'s lines, after the error's
    lines = [line for line in err.child_traceback.splitlines() if line.strip() and not line.startswith(notes)]
    told = [line for line in err.child_traceback.splitlines() if line.startswith((VALUES, RETURNED))]
    departs = [line for line in err.child_traceback.splitlines() if line.startswith(DEPARTS)]
    last = next((line.strip() for line in reversed(lines) if not line.startswith(("(", " "))), lines[-1].strip())
    if err.child_traceback.startswith("process exited with code"):  # spawn's death note: no Python traceback
        fatal = [line.strip() for line in lines if line.startswith("Fatal Python error")]  # faulthandler's first
        last = _aborted(logs, err.rank) or (fatal or [lines[0].strip()])[0]
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)\n\s+(.+)', err.child_traceback)
    mine = [f for f in frames if Path(f[0]) == answer.path]
    dumped = [
        f for f in re.findall(r'File "([^"]+)", line (\d+) in (\S+)', err.child_traceback) if Path(f[0]) == answer.path
    ]
    if not mine and dumped:  # faulthandler's dump: most recent call first, no source line
        path, line, name = dumped[0]
        mine = [(path, line, name, linecache.getline(path, int(line)))]
    where = f"\n  at {answer.path.name}:{mine[-1][1]} in {mine[-1][2]}: {mine[-1][3].strip()}" if mine else ""
    where += f"\n  {told[-1]}" if told else ""  # the values on that line, or what the answer returned
    where += f"\n  {departs[-1]}" if departs else ""  # where it went its own way before the raise
    if TRANSPORT.search(last):
        return (
            f"the ranks stopped running the same collectives: rank {err.rank} was left in one whose peers had "
            f"gone ({last[:120]}){where}{ran}"
        )
    return f"your answer raised on rank {err.rank}: {last}{where}{ran}"


SIZES = re.compile(r"(\d+) vs (\d+)\. Received data size doesn't match expected size")


def _aborted(logs: str | None, rank: int) -> str:
    """What a rank that died in C++ wrote on its stderr (`_rank` keeps it in `logs`/0-<rank>.err): the error's
    type and message ("terminate called after throwing an instance of 'gloo::EnforceNotMet' what(): ..."),
    without the source location; with gloo's size mismatch, the two sizes in words and the rank's last call."""
    path = Path(logs or "") / f"0-{rank}.err"
    text = path.read_text(errors="replace") if logs and path.exists() else ""
    what = re.search(r"what\(\):\s*(?:\[[^\]]*\]\s*)?(.+)", text)
    if what is None:
        said = [line.strip() for line in text.splitlines() if re.search(r"[Ee]rror|[Ee]xception|[Ff]ail", line)]
        return said[-1] if said else ""
    kind = re.search(r"instance of '([^']+)'", text)
    words = f"{kind.group(1) + ': ' if kind else ''}{what.group(1).strip()}"
    sizes = SIZES.search(words)
    if sizes:
        calls = (Path(logs) / f"0-{rank}").read_text().splitlines() if (Path(logs) / f"0-{rank}").exists() else []
        at = f" at its {calls[-1]}" if calls else ""
        words += (
            f" (rank {rank} was sent a message of {sizes.group(1)} bytes{at}, its receive buffer holding "
            f"{sizes.group(2)} bytes: the sender's tensor and the receiver's buffer differ in shape or dtype)"
        )
    return f"its process aborted in C++: {words}"


@contextlib.contextmanager
def _stderr_kept(path: str | None):
    """This process's stderr (fd 2) written to `path` too while an answer runs: a C++ abort (gloo's, c10's)
    writes its error there only, before the process dies; echoed to the real stderr when the answer returns."""
    if path is None:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with open(path, "w+b") as kept:
        os.dup2(kept.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            kept.seek(0)
            os.write(2, kept.read())


def _agreed(ok: bool) -> bool:
    """Whether a claim held on every rank: one all-reduce of the flag, hidden from the answer's watches."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return ok
    flag = torch.tensor([int(ok)])
    with _disable_current_modes():
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _recorded(fn: Callable[..., Any], ran: Ran) -> Callable[..., Any]:
    """`fn` with every collective it runs recorded in `ran`: a function's calls, an autograd Function's forward
    and backward (a subclass of it, whose `apply` runs both under `ran`); any other class is passed as it is."""
    if inspect.isclass(fn) and issubclass(fn, torch.autograd.Function) and fn.vjp is torch.autograd.Function.vjp:

        def forward(*args, **kwargs):
            with ran:
                return fn.forward(*args, **kwargs)

        def backward(*args):
            with ran:
                return fn.backward(*args)

        methods = {"forward": staticmethod(forward), "backward": staticmethod(backward), "__doc__": fn.__doc__}
        return type(fn.__name__, (fn,), methods)
    if not inspect.isfunction(fn):
        return fn

    @functools.wraps(fn)
    def recorded(*args, **kwargs):
        with ran:
            recorded.returned = fn(*args, **kwargs)  # told if the judge's use of it raises (`exercise_values`)
        return recorded.returned

    recorded.ran = ran  # a body running what the answer returned (04's stage and schedule) records it as the answer's
    return recorded


def _shadow(answer, lesson, fn: Callable[..., Any]) -> Shadow | None:
    """The lesson's function shadowing an answer's (`exercise_trace`), for a function that is not the lesson's
    own (the authors' wrong answers, `swapped` into the lesson's module, would shadow themselves) nor a blank."""
    if lesson is None or answer == lesson or not inspect.isfunction(fn) or answer.is_blank():
        return None  # a blank raises at once: no lesson's run to compare it with
    return Shadow(lesson.load(), lesson.path, answer.path, _agreed)


def _rank(
    rt, body: Callable[..., None], answers: list, args: tuple, logs: str | None = None, lesson=None
) -> list[dict]:
    """One rank: each answer in turn, loaded, run through the check's body; what it recorded and which
    collectives the answer ran (also logged under `logs`, for a run that never returns), where it first departs
    from the `lesson`'s function (`exercise_trace`), or that it is blank."""
    reports = []
    for k, answer in enumerate(answers):
        claims, before = Claims(agree=_agreed), len(unknown_ops())
        ran, fn, shadow = Ran(str(Path(logs) / f"{k}-{rt.rank}") if logs else None), None, None
        try:
            with _stderr_kept(str(Path(logs) / f"{k}-{rt.rank}.err") if logs else None):
                loaded = answer.load()
                shadow = _shadow(answer, lesson, loaded)
                fn = _recorded(shadow.wrap(loaded) if shadow else loaded, ran)
                body(rt, fn, claims, *args)
        except NotImplementedError as err:
            reports.append({"blank": str(err) or f"{answer.name} in {answer.path.name}"})
            continue
        except Exception as err:  # told by the parent (`_raised`), with the values on the answer's raising line
            noted(err, answer.path, getattr(fn, "returned", SKIP))
            if shadow is not None and shadow.departs:
                err.add_note(f"{DEPARTS}on rank {rt.rank}, {shadow.departs}")
            raise
        unknown = sorted(set(unknown_ops(before)))
        if unknown:  # first: what the judge could not price makes every byte claim after it unsure
            claims.holds(
                UNKNOWN_CLAIM,
                False,
                what="collectives",
                note=f"the judge cannot price {', '.join(unknown)}",
                hints=(
                    "the judge prices torch.distributed's collectives and the functional ones; this op is neither",
                    "write the exchange with dist.all_reduce, all_gather, reduce_scatter, all_to_all, send/recv",
                ),
            )
            claims.seen.insert(0, claims.seen.pop())
        departs, after = (shadow.departs, shadow.after) if shadow else ("", False)
        reports.append({"seen": claims.seen, "ran": ran.calls, "departs": departs, "after": after})
    return reports
