"""Distributed checkpoints a torn save cannot fool (`distlab.processes.committed`, under lessons 07 and 12's DCP saves).

Four ranks save a DTensor sharded over them (one `.distcp` file per rank) twice, with different values, into
two folders. A folder with three of its four shards copied from the other save (what a save killed half-way
leaves in place), one flipped bit, a truncated shard: each is refused on every rank in one line naming the file.
Teeth: plain `dcp.load` takes the torn folder without a word, and each rank comes back with a different save's
values. A whole folder loads and equals what was saved (bit for bit); a staged folder that was never marked
(a save killed before its commit) is refused; the lessons' runner dresses only its own checks as a bad-input
line; lesson 12's --checkpoint-dir is checked at parse time.

The faults around a save: two concurrent writers (two real process groups, one folder) give one refusal naming
the other writer while the first save stays whole; a full disk (ENOSPC raised inside DCP's shard writer on one
rank) is one line on every rank and the last good save still loads; a commit killed between its two renames is
refused naming the whole copies and the `mv` that takes one back; a truncated file, another save's file and
another save's marker are each named for what they are.
"""

from __future__ import annotations

import ast
import errno
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.filesystem as dcp_filesystem
from helpers import ROOT, parse_lesson_args
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from distlab.processes.committed import (
    MARKER,
    aside_of,
    load_committed,
    lock_of,
    problem_of,
    save_committed,
    staging_of,
    write_marker,
)
from distlab.processes.spawn import spawn

P = 4
ROWS = 8  # 2 rows a rank


def _weights(version: int) -> torch.Tensor:
    return torch.arange(ROWS * 3, dtype=torch.float64).reshape(ROWS, 3) + 1000 * version


def _sharded(version: int):
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    return {"w": distribute_tensor(_weights(version), mesh, [Shard(0)])}


def _save_two(rt, root: str) -> None:
    for version in (1, 2):
        state = _sharded(version)
        save_committed(f"{root}/v{version}", lambda staging, state=state: dcp.save(state, checkpoint_id=staging))


def _load(rt, folder: str, checked: bool) -> dict:
    """This rank's shard after loading `folder` (checked: through `load_committed`), or the error."""
    state = _sharded(0)
    try:
        if checked:
            load_committed(folder, lambda f: dcp.load(state, checkpoint_id=f))
        else:
            dcp.load(state, checkpoint_id=folder)
    except ValueError as err:
        return {"error": str(err)}
    return {"shard": state["w"].to_local().clone(), "rank": rt.rank}


def _shards(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.distcp"))


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """One folder holding the two whole saves v1 and v2 (one spawn for every test that reads them)."""
    root = tmp_path_factory.mktemp("saves")
    spawn(_save_two, P, str(root))
    return root


def test_a_whole_save_loads_bit_for_bit_and_leaves_no_staging(saved):
    assert sorted(p.name for p in saved.iterdir()) == ["v1", "v2"]  # no .partial, no .lock, no .old left
    assert len(_shards(saved / "v2")) == P and (saved / "v2" / MARKER).is_file()
    for out in spawn(_load, P, str(saved / "v2"), True):
        assert torch.equal(out["shard"], _weights(2)[2 * out["rank"] : 2 * out["rank"] + 2])


@pytest.fixture(scope="module")
def damaged(saved, tmp_path_factory) -> dict[str, tuple[Path, str]]:
    """Three damaged copies of save 2, and the file each error must name."""
    tmp_path = tmp_path_factory.mktemp("damaged")
    cases = {}
    torn = tmp_path / "torn"
    shutil.copytree(saved / "v2", torn)
    for shard in _shards(saved / "v1")[1:]:  # three of four shards from the other save
        shutil.copy(shard, torn / shard.name)
    cases["torn"] = (torn, _shards(torn)[1].name)
    flipped = tmp_path / "flipped"
    shutil.copytree(saved / "v2", flipped)
    shard = _shards(flipped)[2]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit
    shard.write_bytes(bytes(data))
    cases["flipped"] = (flipped, shard.name)
    truncated = tmp_path / "truncated"
    shutil.copytree(saved / "v2", truncated)
    shard = _shards(truncated)[0]
    shard.write_bytes(shard.read_bytes()[:-7])
    cases["truncated"] = (truncated, shard.name)
    return cases


def test_torn_flipped_and_truncated_folders_are_refused_on_every_rank_naming_the_file(damaged):
    for case, (folder, name) in damaged.items():
        errors = [out.get("error") for out in spawn(_load, P, str(folder), True)]
        assert len(set(errors)) == 1 and errors[0] is not None, (case, errors)
        assert name in errors[0] and "\n" not in errors[0], (case, errors[0])
        if case == "truncated":
            assert "bytes" in errors[0] and "truncated" in errors[0], errors[0]
        else:
            assert "another save's" in errors[0] and "truncated" not in errors[0], errors[0]


def test_teeth_plain_dcp_load_takes_the_torn_folder_and_mixes_two_saves(damaged):
    folder, _ = damaged["torn"]
    versions = set()
    for out in spawn(_load, P, str(folder), False):
        assert "error" not in out  # loaded without a word
        versions.add(int(out["shard"][0, 0].item()) // 1000)
    assert versions == {1, 2}  # rank 0 holds save 2's rows, ranks 1-3 save 1's


def test_a_staged_folder_never_marked_is_refused_and_a_marked_one_passes(tmp_path):
    folder = tmp_path / "ckpt"
    staging = staging_of(folder)
    staging.mkdir()
    (staging / "__0_0.distcp").write_bytes(b"shard")
    assert "COMMITTED.json is missing" in problem_of(staging)  # a save killed before its marker
    assert problem_of(folder) == f"checkpoint {folder}: no such folder"
    write_marker(staging)
    assert problem_of(staging) is None
    (staging / "extra.distcp").write_bytes(b"x")
    assert "extra.distcp is not listed" in problem_of(staging)


def test_the_runner_dresses_only_its_own_checks_as_a_bad_input_line():
    def run(body: str) -> subprocess.CompletedProcess:
        code = f"from distlab.processes.runtime import run_main\nimport distlab.proof.cli\n{body}"
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)

    check = run("run_main(lambda: distlab.proof.cli.require(False, '--width', 'must be even'))")
    assert check.returncode == 2 and check.stdout.strip() == "error: --width: must be even", check
    assert "Traceback" not in check.stderr
    underneath = run("import torch\nrun_main(lambda: torch.optim.SGD([], lr=0.1))")  # torch's own ValueError
    assert underneath.returncode == 1 and "error:" not in underneath.stdout, underneath
    assert "Traceback" in underneath.stderr and "empty parameter list" in underneath.stderr, underneath.stderr


def test_lesson12_checkpoint_dir_is_checked_at_parse_time(tmp_path):
    code, _, _, err = parse_lesson_args("12_composed_mesh", "--checkpoint-dir", "/etc/passwd")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "argument --checkpoint-dir:" in err, err
    (tmp_path / "notes.txt").write_text("mine")
    code, _, _, err = parse_lesson_args("12_composed_mesh", "--checkpoint-dir", str(tmp_path))
    assert code == 2 and "not a checkpoint's" in err, err
    code, args, _, _ = parse_lesson_args("12_composed_mesh", "--checkpoint-dir", str(tmp_path / "new"))
    assert code is None and args.checkpoint_dir == str(tmp_path / "new")


def _uncommitted_dcp_calls(source: str) -> list[int]:
    """The lines of every `dcp.save(...)` / `dcp.load(...)` call not inside a save_committed / load_committed call."""
    tree = ast.parse(source)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found = []
    for node in ast.walk(tree):
        func = getattr(node, "func", None)
        if isinstance(func, ast.Attribute) and func.attr in ("save", "load") and getattr(func.value, "id", "") == "dcp":
            up = parents.get(node)
            while up is not None and not (
                isinstance(up, ast.Call) and getattr(up.func, "id", "") in ("save_committed", "load_committed")
            ):
                up = parents.get(up)
            if up is None:
                found.append(node.lineno)
    return found


def test_the_library_writes_and_reads_no_distributed_checkpoint_uncommitted():
    """Every dcp.save and dcp.load in the library goes through the commit (a new one would need its own)."""
    assert _uncommitted_dcp_calls("import x as dcp\ndcp.save(state, checkpoint_id=path)\n") == [2]  # can fail
    for path in (ROOT / "src").rglob("*.py"):
        assert _uncommitted_dcp_calls(path.read_text()) == [], path


def _first_writer(rt, folder: str, gate: str) -> dict:
    """Saves version 1, its shards written only once `gate` exists (the second writer has been refused)."""

    def write(staging: str) -> None:
        while not os.path.exists(gate):
            time.sleep(0.05)
        dcp.save(_sharded(1), checkpoint_id=staging)

    save_committed(folder, write)
    return {"pid": os.getpid(), "rows": _load_rows(rt, folder)}


def _second_writer(rt, folder: str) -> str | None:
    try:
        save_committed(folder, lambda staging: dcp.save(_sharded(2), checkpoint_id=staging))
    except ValueError as err:
        return str(err)
    return None


def _load_rows(rt, folder: str) -> torch.Tensor:
    state = _sharded(0)
    load_committed(folder, lambda f: dcp.load(state, checkpoint_id=f))
    return state["w"].to_local().clone()


def test_two_concurrent_writers_one_is_refused_naming_the_other_and_the_first_save_is_whole(tmp_path):
    folder, gate = tmp_path / "ckpt", tmp_path / "gate"
    first: list = []
    thread = threading.Thread(target=lambda: first.extend(spawn(_first_writer, 2, str(folder), str(gate))))
    thread.start()
    try:
        deadline = time.monotonic() + 120
        while not (lock_of(folder).is_file() and lock_of(folder).read_text()):  # the first writer holds the folder
            assert time.monotonic() < deadline and thread.is_alive(), "the first writer never claimed the folder"
            time.sleep(0.05)
        holder = lock_of(folder).read_text()
        errors = spawn(_second_writer, 2, str(folder))
    finally:
        gate.touch()
        thread.join(timeout=180)
    assert len(set(errors)) == 1 and errors[0] is not None and "\n" not in errors[0], errors
    assert str(folder) in errors[0] and "another save is writing it" in errors[0] and holder in errors[0], errors[0]
    assert holder.startswith(f"pid {first[0]['pid']} on host "), (holder, first)  # the first writer's rank 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "gate"]  # no lock, no staging left
    for rank, out in enumerate(first):
        assert torch.equal(out["rows"], _weights(1)[4 * rank : 4 * rank + 4])  # the first writer's save, whole


def _full_disk_then_leftovers(rt, folder: str) -> dict:
    """Save 1 whole; save 2 with rank 1's shard writes failing ENOSPC inside DCP; load; then a commit killed
    between its renames (save 1 moved aside, a whole marked copy staged) and a save into that."""
    save_committed(folder, lambda staging: dcp.save(_sharded(1), checkpoint_id=staging))
    real = dcp_filesystem._write_item

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    if rt.rank == 1:
        dcp_filesystem._write_item = full
    try:
        save_committed(folder, lambda staging: dcp.save(_sharded(2), checkpoint_id=staging))
        out = {"full": None}
    except ValueError as err:
        out = {"full": str(err)}
    finally:
        dcp_filesystem._write_item = real
    out["left"] = sorted(p.name for p in Path(folder).parent.iterdir())
    out["rows"] = _load_rows(rt, folder)
    if rt.rank == 0:
        shutil.copytree(folder, staging_of(Path(folder)))
        os.replace(folder, aside_of(Path(folder)))
    dist.barrier()
    try:
        save_committed(folder, lambda staging: dcp.save(_sharded(3), checkpoint_id=staging))
        out["killed"] = None
    except ValueError as err:
        out["killed"] = str(err)
    return out


def test_a_full_disk_is_one_line_and_the_last_save_loads_and_a_killed_commit_names_its_copies(tmp_path):
    folder = tmp_path / "ckpt"
    outs = spawn(_full_disk_then_leftovers, P, str(folder))
    full = {out["full"] for out in outs}
    assert len(full) == 1 and None not in full, full
    (line,) = full
    assert "\n" not in line and str(folder) in line and "ENOSPC" in line and "rank 1" in line, line
    assert "still holds the last good save" in line, line
    for rank, out in enumerate(outs):
        assert out["left"] == ["ckpt"], out["left"]  # the abandoned staging removed, no lock left
        assert torch.equal(out["rows"], _weights(1)[2 * rank : 2 * rank + 2])  # save 1 loads, whole
    killed = {out["killed"] for out in outs}
    assert len(killed) == 1 and None not in killed, killed
    (line,) = killed
    new, old = staging_of(folder), aside_of(folder)
    assert f"{new} (the new save)" in line and f"{old} (the save before)" in line, line
    assert f"mv {new} {folder}" in line and "\n" not in line, line
    assert (new / MARKER).is_file() and (old / MARKER).is_file()  # the refused save deleted neither copy
    assert problem_of(folder) == line  # a load is refused with the same line


def _marked(folder: Path, contents: dict[str, bytes]) -> Path:
    folder.mkdir()
    for name, data in contents.items():
        (folder / name).write_bytes(data)
    write_marker(folder)
    return folder


def test_each_wrong_file_is_named_for_what_it_is(tmp_path):
    """Truncated (its bytes begin as saved), another save's (they do not), another save's marker (no file is as
    it says). Plain files: the check reads bytes and the marker, not DCP."""
    ours = {".metadata": bytes(range(200)), "__0_0.distcp": bytes(300), "__1_0.distcp": bytes(range(250))}
    other = {".metadata": bytes(range(1, 181)), "__0_0.distcp": b"\x01" * 310, "__1_0.distcp": b"\x02" * 90}
    theirs = _marked(tmp_path / "theirs", other)
    truncated = _marked(tmp_path / "truncated", ours)
    (truncated / "__0_0.distcp").write_bytes(bytes(170))
    assert problem_of(truncated) == (
        f"checkpoint {truncated}: __0_0.distcp holds 170 bytes, the marker says 300, its first 128 bytes as saved: "
        "truncated"
    )
    foreign = _marked(tmp_path / "foreign", ours)
    shutil.copy(theirs / "__0_0.distcp", foreign)
    assert problem_of(foreign) == (
        f"checkpoint {foreign}: __0_0.distcp holds 310 bytes, the marker says 300, and its first 256 bytes differ: "
        "another save's file"
    )
    marker = _marked(tmp_path / "marker", ours)
    shutil.copy(theirs / MARKER, marker)
    line = problem_of(marker)
    assert line.startswith(f"checkpoint {marker}: none of the 3 files {MARKER} lists is as it says"), line
    assert line.endswith("the marker is another save's") and "truncated" not in line, line
