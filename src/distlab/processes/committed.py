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

A folder has one writer. Two runs saving into one folder would stage into the same `<folder>.partial`, each
deleting the other's shards. So the coordinator first claims `<folder>.lock`: an exclusive `flock` on it,
which the kernel drops when its holder dies (a killed save leaves no stale lock), and in it the holder's pid
and host. A second writer finds it held and every rank of its group raises one line naming the folder and
the other writer, before anything is written; the first writer's save goes on whole.

A save that cannot be written leaves the last good one as it was. Every rank reports how its write went
(one all-gather, which is also the barrier): a full disk (ENOSPC, or a quota: EDQUOT), found in the rank's
own OSError or in DCP's CheckpointException, which gathers every rank's, is one line on every rank naming the
folder and the rank that hit it; the coordinator removes the staging folder (its space is freed) and
`<folder>` still holds the previous save. A commit killed between its two renames leaves no `<folder>` but two
whole copies, the old save in `<folder>.old` and the new one in `<folder>.partial`: a load refuses it, and so
does a save (which would delete both), in one line naming the copies and the `mv` that takes one back.

A load first checks the folder against its marker, on the coordinator, and every rank raises the same
one-line ValueError naming the file when anything is off: no marker (written half-way, or not ours), a file
missing, a size or a SHA-256 that differs, a file the marker does not list. A file whose size differs is told
apart by its prefixes: the marker holds the SHA-256 of every file's first 2^k bytes (64 bytes, 128, ... up to
its size, taken from the one pass that hashes it), so a shorter file whose bytes begin as the saved file's is
truncated, and one whose bytes differ from the start is another save's. When no listed file is as the marker
says, it is the marker that belongs to another save. Only then does DCP read it. The check costs one read of
the folder.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import shutil
import socket
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

MARKER = "COMMITTED.json"
STAGING = ".partial"
ASIDE = ".old"
LOCK = ".lock"
DCP_FILES = (".metadata", MARKER)  # besides the shards, `*.distcp`: what a checkpoint folder may hold
SMALLEST_PREFIX = 64  # bytes: the first prefix whose SHA-256 the marker keeps (then 128, 256, ...)
BLOCK = 1 << 20  # bytes read at a time once past the prefixes
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def sha256(path: Path) -> str:
    return fingerprint(path)["sha256"]


def fingerprint(path: Path) -> dict:
    """A file's size, SHA-256, and the SHA-256 of its first 2^k bytes for every 2^k >= 64 up to its size
    (16 hex digits each: enough to tell two files apart, not a security claim). One pass: the reads stop at
    each power of two, where a copy of the running digest is taken."""
    digest, prefixes, done = hashlib.sha256(), {}, 0
    with open(path, "rb") as file:
        while True:
            step = BLOCK if done >= BLOCK else max(SMALLEST_PREFIX, done)  # 64, 64, 128, 256, ...: ends on 2^k
            block = file.read(step)
            if not block:
                break
            digest.update(block)
            done += len(block)
            if len(block) == step and done & (done - 1) == 0:  # a power of two, read whole
                prefixes[str(done)] = digest.copy().hexdigest()[:16]
    return {"bytes": done, "sha256": digest.hexdigest(), "prefixes": prefixes}


def prefix_sha256(path: Path, length: int) -> str:
    with open(path, "rb") as file:
        return hashlib.sha256(file.read(length)).hexdigest()[:16]


def staging_of(folder: Path) -> Path:
    return folder.with_name(folder.name + STAGING)


def aside_of(folder: Path) -> Path:
    return folder.with_name(folder.name + ASIDE)


def lock_of(folder: Path) -> Path:
    return folder.with_name(folder.name + LOCK)


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


def claim(folder: Path) -> int:
    """Become `folder`'s one writer: an exclusive, non-blocking `flock` on `<folder>.lock`, which then names
    this process (pid and host). Returns the lock's descriptor (for `release`); a ValueError naming the
    other writer if it is held. The kernel drops the lock when its holder dies, however it dies."""
    lock = lock_of(folder)
    lock.parent.mkdir(parents=True, exist_ok=True)
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 200).decode(errors="replace").strip() or "a writer starting up"
            os.close(fd)
            raise ValueError(
                f"checkpoint {folder}: another save is writing it ({holder}, holding {lock}); "
                "one folder takes one writer: wait for it, or save to another folder"
            ) from None
        try:
            same = os.stat(lock).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:  # else its holder released it (and removed the file) between our open and our flock: again
            os.ftruncate(fd, 0)
            os.write(fd, f"pid {os.getpid()} on host {socket.gethostname()}".encode())
            return fd
        os.close(fd)


def release(folder: Path, fd: int) -> None:
    """Give up the claim: the file goes first (a writer that opened it before checks the inode, above)."""
    lock_of(folder).unlink(missing_ok=True)
    os.close(fd)


def write_marker(staging: Path) -> dict:
    """`COMMITTED.json` in `staging`, listing every file's size, SHA-256 and prefix SHA-256s; written last,
    via a rename."""
    files = sorted(p for p in staging.iterdir() if p.is_file() and p.name != MARKER)
    marker = {"files": {p.name: fingerprint(p) for p in files}}
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
    aside = aside_of(folder)
    shutil.rmtree(aside, ignore_errors=True)
    if folder.exists():
        os.replace(folder, aside)
    os.replace(staging, folder)
    _fsync_dir(folder.parent)
    shutil.rmtree(aside, ignore_errors=True)


def left_between_renames(folder: Path) -> str | None:
    """With `folder` gone, the whole copies a commit killed between its two renames left (`.old`: the save
    before, `.partial`: the new one, marked), and how to take one back; None when `folder` exists or none is."""
    if folder.exists():
        return None
    whole = [copy for copy in (staging_of(folder), aside_of(folder)) if copy.is_dir() and problem_of(copy) is None]
    if not whole:
        return None
    what = {STAGING: "the new save", ASIDE: "the save before"}
    named = " and ".join(f"{copy} ({what[copy.name[len(folder.name) :]]})" for copy in whole)
    return (
        f"checkpoint {folder}: missing, but a commit killed between its two renames left whole copies: {named}; "
        f"take one back with `mv {whole[0]} {folder}`"
    )


def _differs(path: Path, expected: dict) -> str | None:
    """Why `path` is not the file the marker lists (None: it is): truncated, another save's, or damaged."""
    size = path.stat().st_size
    if size == expected["bytes"]:
        if sha256(path) == expected["sha256"]:
            return None
        return f"{path.name} does not hash to the marker's SHA-256 (a flipped bit, or another save's file of its size)"
    shared = [int(n) for n in expected.get("prefixes", {}) if int(n) <= size]
    said = f"{path.name} holds {size} bytes, the marker says {expected['bytes']}"
    if not shared:  # too short to compare (or a marker without prefixes)
        return f"{said} (truncated, or another save's)"
    if prefix_sha256(path, max(shared)) != expected["prefixes"][str(max(shared))]:
        return f"{said}, and its first {max(shared)} bytes differ: another save's file"
    how = "truncated" if size < expected["bytes"] else "written to after the save"
    return f"{said}, its first {max(shared)} bytes as saved: {how}"


def problem_of(folder: Path) -> str | None:
    """Why `folder` is not a whole committed checkpoint, naming the file (None: it is whole)."""
    if not folder.is_dir():
        return left_between_renames(folder) or f"checkpoint {folder}: no such folder"
    try:
        listed = json.loads((folder / MARKER).read_text())["files"]
    except FileNotFoundError:
        return f"checkpoint {folder}: {MARKER} is missing (a save that did not finish, or not a committed checkpoint)"
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"checkpoint {folder}: {MARKER} cannot be read ({type(err).__name__}: {err})"
    missing = [name for name in listed if not (folder / name).is_file()]
    if missing:
        return f"checkpoint {folder}: {missing[0]} is missing (the marker lists it)"
    differ = {name: why for name in listed if (why := _differs(folder / name, listed[name]))}
    if differ and len(differ) == len(listed) > 1:
        return (
            f"checkpoint {folder}: none of the {len(listed)} files {MARKER} lists is as it says "
            f"(first: {next(iter(differ.values()))}): the marker is another save's"
        )
    if differ:
        return f"checkpoint {folder}: {next(iter(differ.values()))}"
    extra = sorted(p.name for p in folder.iterdir() if p.name != MARKER and p.name not in listed)
    if extra:
        return f"checkpoint {folder}: {extra[0]} is not listed in {MARKER} (added after the save)"
    return None


def disk_full_in(err: BaseException, rank: int) -> tuple[int, OSError] | None:
    """The full-disk OSError behind `err` raised on `rank`, and the rank it happened on: `err` itself or its
    causes (this rank), or any rank's failure DCP's CheckpointException gathered (that rank)."""
    seen: list[tuple[int, BaseException]] = [(rank, err)]
    while seen:
        rank, err = seen.pop()
        if isinstance(err, OSError) and err.errno in DISK_FULL:
            return rank, err
        if isinstance(err, CheckpointException):
            seen += [(failed, failure) for failed, (failure, _) in err.failures.items()]
        seen += [(rank, e) for e in (err.__cause__, err.__context__) if e is not None]
    return None


def _coordinator(group) -> bool:
    return dist.get_rank(group) == 0


def same_verdict(line: str | None, group=None) -> None:
    """The coordinator's line (or None) on every rank of `group`, raised there as one ValueError."""
    verdict = [line]
    dist.broadcast_object_list(verdict, group=group, group_src=0)
    if verdict[0] is not None:
        raise ValueError(verdict[0])


def save_committed(folder: str | Path, write: Callable[[str], None], group=None) -> None:
    """Every rank of `group` calls it: `write(staging)` (e.g. `dcp.save(state, checkpoint_id=staging)`)
    writes every rank's files into the staging folder; the coordinator marks and commits it. Every rank
    returns once the checkpoint is committed, or raises the same one-line ValueError: another writer holds
    the folder, a full disk (the previous save kept), or a commit killed between its renames left copies."""
    folder = Path(folder)
    staging = staging_of(folder)
    lock, line = None, None
    if _coordinator(group):
        try:
            lock = claim(folder)
            line = left_between_renames(folder)  # a save would delete both whole copies: the user picks one
            if line is None:
                shutil.rmtree(staging, ignore_errors=True)  # what a save killed half-way left (no one writes it now)
                staging.mkdir(parents=True)
        except ValueError as err:
            line = str(err)
        if line is not None and lock is not None:
            release(folder, lock)
    same_verdict(line, group)  # every rank: the folder is ours and the staging folder exists, empty
    try:
        try:
            write(str(staging))
            mine = None
        except (OSError, CheckpointException) as err:
            mine = disk_full_in(err, dist.get_rank(group))
            if mine is None:
                raise
        said = [None] * dist.get_world_size(group)
        dist.all_gather_object(said, mine, group=group)  # every rank's shards are on disk, or why not
        full = min((why for why in said if why is not None), key=lambda why: why[0], default=None)
        if full is not None:
            rank, err = full
            line = f"rank {rank}: no space left on the device ({errno.errorcode[err.errno]}: {err.filename or staging})"
        if _coordinator(group):
            if line is None:
                try:
                    write_marker(staging)
                    commit(staging, folder)
                except OSError as err:
                    if disk_full_in(err, 0) is None:
                        raise
                    line = f"rank 0: no space left on the device writing {MARKER} ({errno.errorcode[err.errno]})"
            if line is not None:
                shutil.rmtree(staging, ignore_errors=True)  # frees what the abandoned save took
                kept = "still holds the last good save" if problem_of(folder) is None else "held no good save before"
                line = f"checkpoint {folder}: save abandoned, {line}; {folder} {kept}"
    finally:
        if lock is not None:
            release(folder, lock)
    same_verdict(line, group)  # nobody reads the folder before it is committed


def load_committed(folder: str | Path, read: Callable[[str], None], group=None) -> None:
    """Every rank of `group` calls it: the coordinator checks `folder` against its marker, every rank raises
    the same one-line ValueError naming the file if the check fails, else `read(folder)` (e.g. `dcp.load`)."""
    same_verdict(problem_of(Path(folder)) if _coordinator(group) else None, group)
    read(str(folder))
