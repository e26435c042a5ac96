"""A crash that loses nothing: checkpoints a killed rank cannot corrupt, resuming from the newest
whole one, and the fault that proves it (`--crash-at-step`).

What a training run is at the end of step k: the model's parameters and buffers (CLIP's learned
logit scale among them), the optimizer's state (AdamW: both moments and a step count per parameter,
each group's learning rate), the scheduler's (its step count), what the loop has logged, the data
order, and every random generator a rank draws from (torch's CPU generator, its GPU's, Python's and
NumPy's). Restore all of it and step k + 1 is the step an uninterrupted run takes, bit for bit: the
same batch, the same weights, the same reductions in the same order. The data order here is a
function of the seed and the step alone (`Digits.rows`), so the step is the loader's whole state.

Writing. A rank can die at any instant, a checkpoint included, so nothing is written where a reader
could take it for a finished one. Every rank writes into `step-000012.partial/` (rank 0 the state,
which DDP keeps the same on every rank; rank r its own generators, `rng-r.pt`); after a barrier rank
0 writes `manifest.json`, the SHA-256 of every file, last and via a temporary name, then renames the
directory to `step-000012` (rename is atomic on POSIX). Reading: the newest `step-*` directory whose
manifest exists and whose files hash to what it says; a `.partial` or a torn file is skipped, and
named with the reason. Every rank must find the same newest step (one all-gather): ranks that see
different ones (a node-local directory on a multi-node run) are refused, every rank naming them, rather
than each resuming a different state. `torch.load(weights_only=True)` reads the files: a checkpoint
directory is data, and unpickling arbitrary objects from it could run code.

One writer. Two runs saving into one directory would write into the same `step-000012.partial/`, each
removing the other's files. So rank 0 claims the directory before a save writes anything
(`distlab.processes.committed.claim`: an exclusive flock on `<directory>.lock`, naming its holder, which the
kernel drops when the holder dies) and gives it up after the rename; a second run's save finds it held and
every one of its ranks raises one line naming the directory and the other writer, while the first run's save
goes on whole.

The fault. `--crash-at-step STEP` makes rank `--crash-rank` (default the last) leave through
`os._exit` at the start of step STEP, on torchrun's first attempt only (TORCHELASTIC_RESTART_COUNT =
0): no exception, no cleanup, no goodbye to the process group, as a killed process. torchrun polls its
workers every 0.1 s: it sees the exit, stops the survivors (SIGTERM) within a second, and with
`--max-restarts 1` starts every rank again; they find the checkpoint and go on. Left alone, a survivor
would not wait for the group's timeout either: its next gloo collective finds the dead peer's socket
closed and raises ("Connection reset by peer"). NCCL need not notice a dead peer (not measured here:
one GPU): a survivor may wait out the group's timeout, which is why torchrun's stop is the fast path.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import random
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from distlab.comm.agree import per_rank, rank_table
from distlab.processes.committed import claim, release, same_verdict
from distlab.processes.console import print0
from distlab.processes.identity import Runtime

MANIFEST = "manifest.json"
PARTIAL = ".partial"
KEEP = 2  # complete checkpoints kept; older ones are removed once a newer is whole
CRASH_EXIT_CODE = 17  # what the crashed rank exits with (torchrun reports it)


def parameters_sha256(module: torch.nn.Module) -> str:
    """SHA-256 of every parameter and buffer, in state_dict order, as raw bytes: equal digests are
    bit-identical models."""
    digest = hashlib.sha256()
    for tensor in module.state_dict().values():
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def rng_state(device: torch.device) -> dict:
    """Every generator this rank draws from (NumPy's as plain numbers: loadable with weights_only)."""
    name, keys, pos, has_gauss, gauss = np.random.get_state(legacy=True)
    state = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": (name, keys.tolist(), pos, has_gauss, gauss),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))
    if device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _write(path: Path, obj: Any) -> None:
    """`obj` (bytes as they are, anything else through torch.save), on disk when this returns: a
    machine that loses power keeps it too."""
    with open(path, "wb") as file:
        file.write(obj) if isinstance(obj, bytes) else torch.save(obj, file)
        file.flush()
        os.fsync(file.fileno())


def _state_of(obj: Any) -> Any:
    return copy.deepcopy(obj) if isinstance(obj, dict) else obj.state_dict()


def _load_into(obj: Any, state: Any) -> None:
    if isinstance(obj, dict):  # a plain dict (a log) is restored in place: its holders keep seeing it
        obj.clear()
        obj.update(state)
    else:
        obj.load_state_dict(state)


def _barrier(rt: Runtime) -> int:
    """Every rank has reached this point: one all_reduce of a 1 per rank on the group's device, whose sum
    (the ranks that arrived, P) is read on the host. Reading it is what makes it a barrier under nccl: there
    a collective only queues work on the GPU and returns at once, so rank 0 would go on to hash the other
    ranks' `rng-r.pt` before they were written; `.item()` waits for the sum, which exists only once every
    rank has added its 1. (gloo blocks in the call itself.)"""
    arrived = torch.ones(1, device=rt.device)
    dist.all_reduce(arrived)
    return int(arrived.item())


class Checkpoints:
    """`--checkpoint-dir`'s checkpoints of one run: `restore` at the start, `after_step` after every
    step (writes every `every` steps), `crash_if_asked` before every step. With no directory every
    call does nothing (and the run is the plain lesson)."""

    def __init__(
        self,
        rt: Runtime,
        directory: str | None,
        every: int,
        run: dict,
        crash_at: int | None = None,
        crash_rank: int | None = None,
    ) -> None:
        """`run`: what the run is (a checkpoint of another run is refused, not silently mixed); `crash_at`: the
        step before which rank `crash_rank` (default the last) dies, on torchrun's first attempt."""
        self.rt, self.every = rt, every
        self.directory = Path(directory) if directory is not None else None
        self.run = json.loads(json.dumps(run))  # as it reads back from the manifest
        self.crash_at, self.crash_rank = crash_at, rt.world_size - 1 if crash_rank is None else crash_rank

    def crash_if_asked(self, step: int) -> None:
        """Before step `step` (1-based): the chosen rank dies here on the first attempt."""
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if step == self.crash_at and self.rt.rank == self.crash_rank and first_attempt:
            print(
                f"rank {self.rt.rank}: os._exit({CRASH_EXIT_CODE}) at step {step} (--crash-at-step)",
                file=sys.stderr,
                flush=True,
            )
            os._exit(CRASH_EXIT_CODE)

    def after_step(self, step: int, objects: dict[str, Any]) -> None:
        if self.directory is not None and step % self.every == 0:
            self.save(step, objects)

    def save(self, step: int, objects: dict[str, Any]) -> Path:
        """Claim the directory, write, barrier, manifest, rename, release. Every rank calls it (the verdict on
        the claim and the barrier are collectives); the other ranks return while rank 0 may still be renaming
        (they see it after their next collective). Another writer holding the directory: every rank raises the
        same one-line ValueError naming it, before anything is written."""
        lock, line = None, None
        if self.rt.is_first:
            try:
                lock = claim(self.directory)
            except ValueError as err:
                line = f"--checkpoint-dir: {err}"
        try:
            same_verdict(line)
            return self._write(step, objects)
        finally:
            if lock is not None:
                release(self.directory, lock)

    def _write(self, step: int, objects: dict[str, Any]) -> Path:
        partial = self.directory / f"step-{step:06d}{PARTIAL}"
        partial.mkdir(parents=True, exist_ok=True)
        if self.rt.is_first:
            _write(partial / "state.pt", {"step": step, **{k: _state_of(v) for k, v in objects.items()}})
        _write(partial / f"rng-{self.rt.rank}.pt", rng_state(self.rt.device))
        arrived = _barrier(self.rt)  # every rank's files are whole; a rank that died never gets past here
        if arrived != self.rt.world_size:
            raise RuntimeError(f"checkpoint barrier: {arrived} of {self.rt.world_size} ranks arrived")
        final = self.directory / f"step-{step:06d}"
        if self.rt.is_first:
            files = ["state.pt"] + [f"rng-{r}.pt" for r in range(self.rt.world_size)]
            manifest = {
                "step": step,
                "world_size": self.rt.world_size,
                "run": self.run,
                "sha256": {name: _sha256(partial / name) for name in files},
            }
            _write(partial / (MANIFEST + ".tmp"), json.dumps(manifest, indent=1).encode())
            os.replace(partial / (MANIFEST + ".tmp"), partial / MANIFEST)
            shutil.rmtree(final, ignore_errors=True)  # an invalid leftover of the same step, if any
            os.replace(partial, final)
            for old in self.complete()[:-KEEP]:
                shutil.rmtree(self.directory / f"step-{old:06d}")
        return final

    def skipped(self) -> list[tuple[Path, str]]:
        """Every checkpoint directory that is not loaded, and why."""
        if self.directory is None or not self.directory.is_dir():
            return []
        out = []
        for folder in sorted(self.directory.glob("step-*")):
            number = folder.name[len("step-") :]
            if folder.name.endswith(PARTIAL):
                out.append((folder, "written half-way (never renamed from .partial)"))
            elif folder.is_dir() and number.isdigit() and (why := self.inspect(int(number))[1]):
                out.append((folder, why))
        return out

    def complete(self) -> list[int]:
        """The steps of the whole checkpoints in the directory, oldest first."""
        if self.directory is None or not self.directory.is_dir():
            return []
        steps = [
            int(p.name[len("step-") :])
            for p in self.directory.glob("step-*")
            if p.is_dir() and p.name[len("step-") :].isdigit()
        ]
        return sorted(step for step in steps if self.verify(step) is not None)

    def verify(self, step: int) -> dict | None:
        """The checkpoint's manifest if every file it lists hashes to what it says, else None."""
        return self.inspect(step)[0]

    def inspect(self, step: int) -> tuple[dict | None, str]:
        """(the manifest, "") for a whole checkpoint, else (None, why it cannot be loaded)."""
        folder = self.directory / f"step-{step:06d}"
        try:
            manifest = json.loads((folder / MANIFEST).read_text())
            torn = [name for name, digest in manifest["sha256"].items() if _sha256(folder / name) != digest]
        except FileNotFoundError as err:
            return None, f"{Path(err.filename).name} is missing (written half-way?)"
        except (OSError, ValueError, KeyError, TypeError) as err:
            return None, f"its manifest cannot be read ({type(err).__name__}: {err})"
        if torn:
            return None, f"{', '.join(torn)} no longer hash{'es' if len(torn) == 1 else ''} to the manifest's SHA-256"
        if manifest.get("step") != step:
            return None, f"its manifest says step {manifest.get('step')}"
        return manifest, ""

    def restore(self, objects: dict[str, Any]) -> int:
        """Load the newest whole checkpoint into `objects` and this rank's generators; the step it
        was written after (0: none, start from the beginning). Every rank calls it."""
        if self.directory is None:
            return 0
        found = self.complete()
        if self.rt.is_first:
            for folder, why in self.skipped():
                print0(f"skipped {folder}: {why}", highlight=False)
        seen = rank_table([found[-1] if found else 0], self.rt.device)[:, 0].tolist()  # every rank's newest
        if len(set(seen)) > 1:  # a node-local directory, or a copy that differs: refuse, never mix two runs' states
            raise ValueError(
                "--checkpoint-dir: the ranks see different newest checkpoints "
                f"({per_rank(seen, lambda v: f'step {v:g}' if v else 'none')}): every rank must read the "
                "same directory (a shared filesystem on a multi-node run)"
            )
        step = int(seen[0])
        if step == 0:
            return 0
        manifest, folder = self.verify(step), self.directory / f"step-{step:06d}"
        if manifest["world_size"] != self.rt.world_size or manifest["run"] != self.run:
            raise ValueError(
                f"--checkpoint-dir: {folder} belongs to another run "
                f"(P={manifest['world_size']}, {manifest['run']}); use another directory"
            )
        state = torch.load(folder / "state.pt", map_location="cpu", weights_only=True)
        for name, obj in objects.items():
            _load_into(obj, state[name])
        rng = torch.load(folder / f"rng-{self.rt.rank}.pt", map_location="cpu", weights_only=True)
        set_rng_state(rng, self.rt.device)
        print0(f"resumed from {folder} (after step {step}, manifest verified)", highlight=False)
        return step
