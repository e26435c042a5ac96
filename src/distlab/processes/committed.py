"""A distributed checkpoint folder that is whole or refused: staged, then committed by a marker written last.

`torch.distributed.checkpoint` (DCP) has every rank write its shards (`__r_0.distcp`) and rank 0 one
`.metadata` file into the folder it is given, and `dcp.load` reads whatever it finds there. Written straight
into the target, a save that dies half-way leaves a folder that looks like a checkpoint: some shards of the new
save beside shards of an older one (a torn checkpoint), and `dcp.load` takes it, each rank a different state.
A flipped bit in a shard loads too, and a truncated one fails deep inside the unpickler naming no file.

So a save here goes in three steps:

1. stage: every rank writes into `<folder>.partial` (a sibling, removed first if a dead save left it);
2. mark: once every rank's shards are on disk, the coordinator (rank 0 of the group) writes `COMMITTED.json`
   into the staging folder, last, through a temporary name and a rename: every file's size in bytes and its
   SHA-256. The marker exists only once the whole checkpoint does;
3. commit: the staging folder replaces the target (two renames, each atomic on POSIX; the old checkpoint,
   moved aside to `<folder>.old`, is removed after). A reader sees the old whole checkpoint, the new whole
   one, or, killed between the two renames, none (the `.old` is still there): never a mix.

A load first checks the folder against its marker, on the coordinator, and every rank raises the same
one-line ValueError naming the file when anything is off: no marker (written half-way, or not ours), a file
missing, a size (a truncated shard) or a SHA-256 (shards copied from another save, a flipped bit) that differs,
a file the marker does not list. Only then does DCP read it. The check costs one read of the folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

MARKER = "COMMITTED.json"
STAGING = ".partial"
ASIDE = ".old"
DCP_FILES = (".metadata", MARKER)  # besides the shards, `*.distcp`: what a checkpoint folder may hold


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def staging_of(folder: Path) -> Path:
    return folder.with_name(folder.name + STAGING)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def holds_only_checkpoint(folder: Path) -> bool:
    """True for a folder that is missing, empty, or holds only what a DCP checkpoint holds: a save may
    replace it. A folder with anything else in it is not ours to replace."""
    if not folder.exists():
        return True
    return all(p.is_file() and (p.name in DCP_FILES or p.suffix == ".distcp") for p in folder.iterdir())


def write_marker(staging: Path) -> dict:
    """`COMMITTED.json` in `staging`, listing every file's size and SHA-256; written last, via a rename."""
    files = sorted(p for p in staging.iterdir() if p.is_file() and p.name != MARKER)
    marker = {"files": {p.name: {"bytes": p.stat().st_size, "sha256": sha256(p)} for p in files}}
    temporary = staging / (MARKER + ".tmp")
    with open(temporary, "w") as file:
        json.dump(marker, file, indent=1)
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, staging / MARKER)
    _fsync_dir(staging)
    return marker


def commit(staging: Path, folder: Path) -> None:
    """Put the marked staging folder where `folder` was: the old one aside, the new one in, the old one gone."""
    aside = folder.with_name(folder.name + ASIDE)
    shutil.rmtree(aside, ignore_errors=True)
    if folder.exists():
        os.replace(folder, aside)
    os.replace(staging, folder)
    _fsync_dir(folder.parent)
    shutil.rmtree(aside, ignore_errors=True)


def problem_of(folder: Path) -> str | None:
    """Why `folder` is not a whole committed checkpoint, naming the file (None: it is whole)."""
    if not folder.is_dir():
        return f"checkpoint {folder}: no such folder"
    try:
        listed = json.loads((folder / MARKER).read_text())["files"]
    except FileNotFoundError:
        return f"checkpoint {folder}: {MARKER} is missing (a save that did not finish, or not a committed checkpoint)"
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"checkpoint {folder}: {MARKER} cannot be read ({type(err).__name__}: {err})"
    for name, expected in listed.items():
        path = folder / name
        if not path.is_file():
            return f"checkpoint {folder}: {name} is missing (the marker lists it)"
        size = path.stat().st_size
        if size != expected["bytes"]:
            return f"checkpoint {folder}: {name} holds {size} bytes, the marker says {expected['bytes']} (truncated?)"
        if sha256(path) != expected["sha256"]:
            return (
                f"checkpoint {folder}: {name} does not hash to the marker's SHA-256 "
                "(damaged, or copied from another save)"
            )
    extra = sorted(p.name for p in folder.iterdir() if p.name != MARKER and p.name not in listed)
    if extra:
        return f"checkpoint {folder}: {extra[0]} is not listed in {MARKER} (added after the save)"
    return None


def _coordinator(group) -> bool:
    return dist.get_rank(group) == 0


def _barrier(group) -> None:
    dist.barrier(group=group)


def save_committed(folder: str | Path, write: Callable[[str], None], group=None) -> None:
    """Every rank of `group` calls it: `write(staging)` (e.g. `dcp.save(state, checkpoint_id=staging)`)
    writes every rank's files into the staging folder; the coordinator marks and commits it. Every rank
    returns once the checkpoint is committed."""
    folder = Path(folder)
    staging = staging_of(folder)
    if _coordinator(group):
        shutil.rmtree(staging, ignore_errors=True)  # what a save killed half-way left
        staging.mkdir(parents=True)
    _barrier(group)  # the staging folder exists, empty, for every rank
    write(str(staging))
    _barrier(group)  # every rank's shards are on disk (a dead rank never passes: nothing is committed)
    if _coordinator(group):
        write_marker(staging)
        commit(staging, folder)
    _barrier(group)  # nobody reads the folder before it is committed


def load_committed(folder: str | Path, read: Callable[[str], None], group=None) -> None:
    """Every rank of `group` calls it: the coordinator checks `folder` against its marker, every rank raises
    the same one-line ValueError naming the file if the check fails, else `read(folder)` (e.g. `dcp.load`)."""
    verdict = [problem_of(Path(folder)) if _coordinator(group) else None]
    dist.broadcast_object_list(verdict, group=group, group_src=0)
    if verdict[0] is not None:
        raise ValueError(verdict[0])
    read(str(folder))
