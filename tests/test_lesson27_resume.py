"""A crash that loses nothing (lesson 27's --checkpoint-dir and --crash-at-step; issue 19 item 5).

Under `torchrun --max-restarts 1`, rank 1 exits abruptly at step 13 of 20; torchrun stops rank 0 and
restarts both; they resume from the checkpoint written after step 10 and finish. The parameters'
SHA-256 equals an uninterrupted run's: every bit of the model, optimizer, scheduler, data order and
random state came back. And the pieces: a checkpoint a dying rank left half-written (no manifest, or
a file that no longer hashes to what the manifest says) is never loaded; a checkpoint of another run
is refused; a second writer of one directory is refused in one line naming it and the first writer; the flags
are refused in one line naming the flag.
"""

import os
import re

import pytest
import torch
from helpers import assert_flag_refused, torchrun

from distlab.contrastive.checkpointing import Checkpoints
from distlab.processes.spawn import spawn

LESSON = "train_clip"
# 20 steps of N = 64 clear the lesson's 80% accuracy claim (about 90%); checkpoints after steps 5, 10, ...
RUN = ("--steps", "20", "--warmup", "2", "--global-batch", "64", "--eval-every", "10")
DIGEST = re.compile(r"parameters sha256:\s+([0-9a-f]{64})\n")  # (at 80 columns rich wraps before the hex)


def _digest(stdout: str) -> str:
    found = DIGEST.findall(stdout)
    assert len(found) == 1, stdout
    return found[0]


def test_a_crashed_and_resumed_run_ends_bit_identical_to_an_uninterrupted_one(tmp_path):
    straight = torchrun(LESSON, 2, *RUN)
    assert straight.returncode == 0, straight.stdout + straight.stderr[-3000:]
    crashed = torchrun(
        LESSON,
        2,
        *RUN,
        "--checkpoint-dir",
        str(tmp_path),
        "--checkpoint-every",
        "5",
        "--crash-at-step",
        "13",
        max_restarts=1,
    )
    output = crashed.stdout + crashed.stderr
    assert crashed.returncode == 0, output[-5000:]
    assert "rank 1: os._exit(17) at step 13 (--crash-at-step)" in output  # the fault happened,
    assert f"resumed from {tmp_path / 'step-000010'} (after step 10" in crashed.stdout  # once, and was survived
    assert crashed.stdout.count("Lesson 27") == 2 and "PASS: every claim holds" in crashed.stdout
    assert _digest(crashed.stdout) == _digest(straight.stdout)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000015", "step-000020"]  # the newest two


# ---------------------------------------------------------------------------------------------
# The checkpoint files, on two ranks in one process (spawn)
# ---------------------------------------------------------------------------------------------


def _run_state(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda t: 1 / (t + 1))
    return {"model": model, "optimizer": optimizer, "scheduler": scheduler, "log": {"loss": []}}


def _train_step(state: dict) -> None:
    state["optimizer"].zero_grad()
    loss = state["model"](torch.randn(4, 3)).square().sum()  # draws from the global generator
    loss.backward()
    state["optimizer"].step()
    state["scheduler"].step()
    state["log"]["loss"].append(loss.item())


def _lose_the_manifest(folder) -> None:
    (folder / "manifest.json").unlink()


def _flip_a_bit(folder) -> None:
    data = bytearray((folder / "state.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (folder / "state.pt").write_bytes(bytes(data))


def _save_tear_restore(rt, directory: str):
    """Save after steps 1, 2 and 3; step 2 loses its manifest (a rank died before rank 0 wrote it), a bit of
    step 3's state flips (a file changed after its hash was taken) and a .partial of step 4 is left behind;
    restore into a fresh state: it must be step 1's, bit for bit, each rank's generator included. (The state is
    the same on every rank, as under DDP; the generators are not.) Then the same directory restored as another
    run: refused (its error, or "no error")."""
    run = {"lr": 0.1}
    checkpoints, state = Checkpoints(rt, directory, 1, run), _run_state(0)
    _train_step(state)
    torch.rand(rt.rank + 1)  # each rank's generator elsewhere
    checkpoints.after_step(1, state)
    saved = ({k: v.clone() for k, v in state["model"].state_dict().items()}, torch.rand(3), list(state["log"]["loss"]))
    for step, tear in ((2, _lose_the_manifest), (3, _flip_a_bit)):  # (a torn step 2 is not kept over step 1)
        _train_step(state)
        checkpoints.after_step(step, state)
        torch.distributed.barrier()  # rank 0 has renamed it by now
        if rt.is_first:
            tear(checkpoints.directory / f"step-{step:06d}")
    if rt.is_first:
        (checkpoints.directory / "step-000004.partial").mkdir()
        torch.save({"step": 4}, checkpoints.directory / "step-000004.partial" / "state.pt")
    torch.distributed.barrier()
    fresh = _run_state(100)
    step = Checkpoints(rt, directory, 1, run).restore(fresh)
    params, next_draw, log = saved
    result = (
        step,
        all(torch.equal(params[k], v) for k, v in fresh["model"].state_dict().items()),
        torch.equal(torch.rand(3), next_draw),
        fresh["log"]["loss"] == log,
        fresh["scheduler"].last_epoch,
        len(fresh["optimizer"].state),
        [(folder.name, why) for folder, why in Checkpoints(rt, directory, 1, run).skipped()],
    )
    try:
        Checkpoints(rt, directory, 1, {"lr": 0.2}).restore(_run_state(0))
    except ValueError as err:
        return result, str(err)
    return result, "no error"


def test_half_written_checkpoints_are_never_loaded_and_another_run_s_is_refused(tmp_path):
    for rank_result, another_run in spawn(_save_tear_restore, 2, str(tmp_path)):
        assert rank_result[:6] == (1, True, True, True, 1, 2)
        skipped = rank_result[6]  # each named with its reason (rank 0 prints these before it resumes)
        assert [name for name, _ in skipped] == ["step-000002", "step-000003", "step-000004.partial"], skipped
        assert skipped[0][1].startswith("manifest.json is missing"), skipped
        assert skipped[1][1].startswith("state.pt no longer hashes to the manifest's"), skipped
        assert "half-way" in skipped[2][1], skipped
        assert re.match(r"--checkpoint-dir: .* belongs to another run", another_run), another_run


def _restore_from_different_directories(rt, shared: str, local: str):
    """(the restore's error, or "no error"; the checkpoint barrier's count of the ranks)."""
    from distlab.contrastive.checkpointing import _barrier

    Checkpoints(rt, shared, 1, {"lr": 0.1}).save(1, _run_state(0))
    torch.distributed.barrier()  # rank 0 has renamed it by now
    directory = shared if rt.rank == 0 else local  # ranks 1 and 2 read a node-local directory that has none
    try:
        Checkpoints(rt, directory, 1, {"lr": 0.1}).restore(_run_state(0))
    except ValueError as err:
        return str(err), _barrier(rt)
    return "no error", _barrier(rt)


def test_ranks_that_see_different_newest_checkpoints_are_refused_naming_them_and_the_barrier_counts_them(tmp_path):
    """The refusal names every rank's newest step. The barrier is a sum read on the host (an int), which under
    nccl is what makes the host wait for it (the call alone only queues the all-reduce); here, on gloo, that
    every rank is counted."""
    results = spawn(_restore_from_different_directories, 3, str(tmp_path / "shared"), str(tmp_path / "local"))
    errors, counts = zip(*results)
    assert len(set(errors)) == 1 and errors[0] != "no error", errors
    assert "rank 0: step 1, rank 1: none, rank 2: none" in errors[0] and "same directory" in errors[0], errors[0]
    assert counts == (3, 3, 3), counts


def test_a_second_writer_is_refused_naming_the_directory_and_the_first(tmp_path):
    """Two claims on one directory, in this process (a one-rank group): a run's save while another writer holds
    the directory (`committed.claim`, as a second run's rank 0 would find it) is one line naming the directory and
    that writer, and writes nothing; once the first writer is gone, the same save goes through and leaves no lock
    (so the refusal is the claim's, not the save's)."""
    from distlab.processes.committed import claim, lock_of, release
    from distlab.processes.identity import Runtime

    assert not torch.distributed.is_initialized()
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    try:
        rt = Runtime(rank=0, world_size=1, local_rank=0, backend="gloo", device=torch.device("cpu"))
        # No optimizer in the state: its first construction imports torch._dynamo, seconds.
        directory, state = tmp_path / "ckpt", {"model": torch.nn.Linear(3, 2), "log": {"loss": [1.0]}}
        first = claim(directory)  # the other writer
        holder = lock_of(directory).read_text()
        with pytest.raises(ValueError) as refused:
            Checkpoints(rt, str(directory), 1, {"lr": 0.1}).save(1, state)
        release(directory, first)
        line = str(refused.value)
        assert "\n" not in line and line.startswith(f"--checkpoint-dir: checkpoint {directory}: another save"), line
        assert holder in line and holder.startswith(f"pid {os.getpid()} on host "), (holder, line)
        assert not directory.exists() or not any(directory.iterdir())  # nothing written
        Checkpoints(rt, str(directory), 1, {"lr": 0.1}).save(1, state)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # the lock given up
        assert [p.name for p in directory.iterdir()] == ["step-000001"]
    finally:
        torch.distributed.destroy_process_group()


def test_bad_resume_flags_are_one_line_naming_the_flag(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert_flag_refused(LESSON, "--crash-at-step", "--crash-at-step", "3")  # no --checkpoint-dir
    assert_flag_refused(LESSON, "--crash-at-step", "--checkpoint-dir", "x", "--steps", "20", "--crash-at-step", "21")
    assert_flag_refused(LESSON, "--crash-rank", "--checkpoint-dir", "x", "--crash-at-step", "3", "--crash-rank", "2")
    assert_flag_refused(LESSON, "--checkpoint-every", "--checkpoint-every", "0")


def unsafe_loads(source: str) -> list[str]:
    """The torch.load calls in `source` that may unpickle code (no weights_only=True)."""
    return [call for call in re.findall(r"torch\.load\(([^)]*)\)", source) if "weights_only=True" not in call]


def test_every_checkpoint_load_keeps_weights_only_and_the_docs_say_a_directory_must_be_trusted():
    """torch.load with weights_only=False (or dcp.load's .metadata) unpickles: a planted file could run code."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    source = (root / "src" / "distlab" / "contrastive" / "checkpointing.py").read_text()
    assert "torch.load(" in source and unsafe_loads(source) == []
    assert unsafe_loads('torch.load(folder / "state.pt", map_location="cpu")')  # the check can fail
    for doc in (root / "lessons" / "07_sharding.py", root / "docs" / "results.md"):
        assert "checkpoint directory must be trusted" in " ".join(doc.read_text().split()).lower(), doc
