"""Every file is written whole through one helper (accel_fsdp/files.py): writers that share a PID (the local main
ranks of several machines under PID namespaces, or two writers in one process) never share a temporary name, and an
interrupted write leaves what was there."""

from __future__ import annotations

import os
import socket
import threading

import numpy as np
import pytest

from accel_fsdp import files
from accel_fsdp.data import synthetic


def _race(write, rounds: int) -> list[BaseException]:
    """Two threads (one PID) run `write(k)` `rounds` times each, at once; the exceptions they met."""
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def run(k: int) -> None:
        start.wait()
        for _ in range(rounds):
            try:
                write(k)
            except BaseException as e:  # noqa: BLE001 - what a writer met is the test's finding
                errors.append(e)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def test_two_writers_with_one_pid_never_share_a_temporary_name_and_the_file_is_whole(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "getpid", lambda: 1)  # as two machines' local main ranks in containers often are
    target = tmp_path / "shared" / "table.bin"
    target.parent.mkdir()
    payloads = [bytes([65 + k]) * (4 << 20) for k in range(2)]
    seen: list[str] = []
    whole = []
    real = files.temporary_sibling

    def recorded(path):
        name = real(path)
        seen.append(name.name)
        return name

    monkeypatch.setattr(files, "temporary_sibling", recorded)

    def write(k: int) -> None:
        files.write_atomic(target, payloads[k])
        whole.append(target.read_bytes() in payloads)

    errors = _race(write, 20)
    assert not errors, errors[:3]
    assert len(seen) == len(set(seen)) == 40 and all(".tmp-" in n and "-1-" in n for n in seen)
    assert all(whole) and target.read_bytes() in payloads
    assert not files.temporaries_of(target)


def test_built_in_data_written_by_two_writers_at_once_is_whole(tmp_path, monkeypatch):
    monkeypatch.setenv("ACCEL_FSDP_CACHE", str(tmp_path))
    monkeypatch.setattr(os, "getpid", lambda: 1)
    paths: list = []

    def write(_k: int) -> None:
        path = synthetic.write_builtin("quickstart", rows=3000, seed=5)
        paths.append(path)
        path.unlink(missing_ok=True)  # the next round writes it again

    assert not _race(write, 5)
    final = synthetic.write_builtin("quickstart", rows=3000, seed=5)
    assert len(final.read_text().splitlines()) == 3000 and not files.temporaries_of(final)


def test_an_interrupted_folder_leaves_the_old_one_whole_and_no_temporary(tmp_path):
    folder = tmp_path / "entry"
    with files.atomic_folder(folder) as building:
        (building / "a.bin").write_bytes(b"old")
    with pytest.raises(KeyboardInterrupt):
        with files.atomic_folder(folder) as building:
            (building / "a.bin").write_bytes(b"new, half")
            raise KeyboardInterrupt
    assert (folder / "a.bin").read_bytes() == b"old" and not files.temporaries_of(folder)
    with files.atomic_folder(folder) as building:
        np.arange(4).tofile(building / "a.bin")
    assert np.fromfile(folder / "a.bin", dtype=np.int64).tolist() == [0, 1, 2, 3]
    assert [p.name for p in tmp_path.iterdir()] == ["entry"]


def test_a_temporary_name_tells_its_writer_and_only_dead_writers_are_swept(tmp_path):
    target = tmp_path / "out"
    mine = files.temporary_sibling(target)
    assert files.temporary_writer(mine) == (socket.gethostname(), os.getpid())
    dead = tmp_path / f".out.tmp-{socket.gethostname()}-999999999-00aa11bb"
    other = tmp_path / ".out.tmp-a-host-with-dashes-999999999-00aa11bb"
    for p in (mine, dead, other):
        p.mkdir()
    assert files.temporary_writer(other) == ("a-host-with-dashes", 999999999)
    assert files.remove_dead_temporaries(target) == [dead]
    assert mine.exists() and other.exists()


def test_the_one_lock_is_exclusive_and_says_who_holds_it(tmp_path):
    lock = files.FileLock(tmp_path / "x.lock")
    assert lock.acquire(wait=False) and lock.held
    other = files.FileLock(tmp_path / "x.lock")
    assert not other.acquire(wait=False)
    assert f"held by PID {os.getpid()}" in other.holder()
    lock.release()
    assert other.holder() is None and other.acquire(wait=False)
    other.release()


def test_a_scratch_folder_is_private_removed_after_use_and_swept_after_a_kill(tmp_path, monkeypatch):
    """bench, the launcher's rank records and the profiler's raw trace use the temporary folder: what a SIGKILLed
    process left there (a bench's run folders with their checkpoints) goes with the next user of the same kind."""
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    killed = tmp_path / f".accel-fsdp-bench.tmp-{socket.gethostname()}-999999999-00aa11bb"
    running = tmp_path / f".accel-fsdp-bench.tmp-{socket.gethostname()}-{os.getppid()}-00aa11bb"
    for folder in (killed, running):
        (folder / "run-1").mkdir(parents=True)
    with files.scratch_folder("accel-fsdp-bench") as work:
        assert work.parent == tmp_path and (work.stat().st_mode & 0o777) == 0o700
        (work / "run-2").mkdir()
        assert not killed.exists() and running.exists()
    assert not work.exists()
    with pytest.raises(KeyboardInterrupt), files.scratch_folder("accel-fsdp-bench") as work:
        raise KeyboardInterrupt
    assert not work.exists() and running.exists()
