"""A checkpoint being read (`checkpoint consolidate` of a live run) is not rotated away under its reader: readers hold
a shared lock on its `.reading-` file (checkpoint/store.py `reading`), rotation deletes only what it can lock
exclusively, and takes a passed-over checkpoint at a later save. Before, consolidating a run that saved every step with
keep_last 1 failed every time, "incomplete or corrupt checkpoint" halfway through."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from conftest import fabricate_checkpoint, read_metrics, run_cli, run_in_process, tiny_recipe

from accel_fsdp.checkpoint.store import reading, rotate
from accel_fsdp.files import FileLock
from accel_fsdp.layout import READING_PREFIX, reading_lock


def steps(folder):
    return sorted(p.name for p in folder.iterdir() if not p.name.startswith(".trash-"))


def test_rotation_passes_over_a_checkpoint_being_read_and_takes_it_later(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (1, 2, 3):
        fabricate_checkpoint(root, step)
    with reading(tmp_path / "checkpoints" / "step-000002") as point:
        assert point.checkpoint.path == root / "step-000002"
        assert rotate(root, keep_last=1, newest=3) == [root / "step-000001"]
        assert steps(root) == [".reading-step-000002", "step-000002", "step-000003"]
    assert steps(root) == ["step-000002", "step-000003"]  # the last reader removed its lock file
    fabricate_checkpoint(root, 4)
    (root / (READING_PREFIX + "step-000001")).write_text("")  # a reader killed after rotation took its checkpoint
    assert rotate(root, keep_last=1, newest=4) == [root / "step-000002", root / "step-000003"]
    assert steps(root) == ["step-000004"]


def test_a_run_folder_is_read_at_its_newest_checkpoint_and_a_damaged_one_is_passed_over_under_the_lock(tmp_path):
    root = tmp_path / "run" / "checkpoints"
    for step in (1, 2):
        fabricate_checkpoint(root, step)
    (root / "step-000002" / "weights").write_bytes(b"\xff" * 32)  # same size, other bytes: only its CRC-32 tells
    with reading(tmp_path / "run") as point:
        assert point.checkpoint.path == root / "step-000001"
        assert [c.path for c in point.passed_over] == [root / "step-000002"]
        assert not FileLock(reading_lock(root / "step-000001")).acquire(wait=False)  # held by this reader


def test_a_reader_waiting_for_a_lock_file_that_rotation_removes_locks_the_one_the_path_names(tmp_path, monkeypatch):
    """Rotation removes the lock file it held; a reader that had opened the old one and waited in flock must not end
    holding a lock on a file nobody else sees. The removal is made to happen inside the reader's first flock."""
    import fcntl

    from accel_fsdp import files

    path = tmp_path / (READING_PREFIX + "step-000001")
    flocked = []
    real_flock = fcntl.flock

    def flock(fd, operation):
        if not flocked:  # while this waited, the holder removed the file, and another reader made it anew
            path.unlink()
            path.write_text("")
        flocked.append(fd)
        return real_flock(fd, operation)

    monkeypatch.setattr(files.fcntl, "flock", flock)
    reader = FileLock(path)
    assert reader.acquire(wait=True, shared=True)
    monkeypatch.undo()
    assert len(flocked) == 2  # opened again, and locked there
    assert not FileLock(path).acquire(wait=False)  # the file the path names now is the one held
    reader.release()


def test_a_checkpoint_folder_this_user_cannot_write_is_read_without_a_lock(tmp_path, monkeypatch):
    """Another user's run, read-only to this one: no lock file can be made there (and this user's rotation never runs
    there)."""
    import errno

    from accel_fsdp.checkpoint import store

    class Unwritable(FileLock):
        def acquire(self, *, wait, shared=False):
            raise PermissionError(errno.EACCES, "Permission denied", str(self.path))

    root = tmp_path / "checkpoints"
    fabricate_checkpoint(root, 1)
    monkeypatch.setattr(store, "FileLock", Unwritable)
    with reading(root / "step-000001") as point:
        assert point.checkpoint.path == root / "step-000001"
    assert steps(root) == ["step-000001"]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_consolidating_a_live_run_that_saves_every_step_with_keep_last_1(tmp_path, tiny_gpt2, stories):
    recipe = tiny_recipe(tmp_path / "r.yaml", tiny_gpt2, stories, checkpoint={"every_steps": 1, "keep_last": 1},
                         training={"max_steps": 40}, logging={"every_steps": 50, "sample_prompt": None})
    run = tmp_path / "run"
    live = subprocess.Popen([sys.executable, "-m", "accel_fsdp", "recipe", "run", str(recipe), "--output-dir",
                             str(run)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        while not list((run / "checkpoints").glob("step-*")):
            assert live.poll() is None, live.stdout.read()[-3000:]
            time.sleep(0.2)
        exported = 0
        while live.poll() is None:
            proc = run_in_process("checkpoint", "consolidate", run, tmp_path / f"out-{exported}")
            assert proc.returncode == 0, proc.stderr[-3000:]
            exported += 1
        assert exported >= 2
        assert live.wait() == 0
    finally:
        live.kill()
        live.wait()
    assert [r["step"] for r in read_metrics(run) if r["kind"] == "train"][-1] == 40
    left = sorted(p.name for p in (run / "checkpoints").iterdir())
    # Rotation took every checkpoint it passed over at a later save; the last one may have been read at the last
    # save, with none after it (a resume's saves take it). No lock file is left.
    assert left[0] == ".accel-fsdp-run" and left[-1] == "step-000040" and len(left) <= 3, left
    assert all(name.startswith("step-") for name in left[1:]), left
    assert run_cli("checkpoint", "consolidate", run, tmp_path / "final", check=0).returncode == 0
