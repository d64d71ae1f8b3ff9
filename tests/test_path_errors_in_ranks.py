"""A path or disk the user chose that fails a write inside a rank is the user's (exit 2, one message), as it is in a
command of one process (cli/main.py): errors.py `path_problem`, read by both."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from accel_fsdp.errors import path_problem
from accel_fsdp.train import lifetime
from accel_fsdp.train.metrics import MetricsWriter, StartupRow


def test_a_full_disk_is_the_users_with_or_without_a_file_named():
    named = path_problem(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/runs/a/metrics.jsonl"), "rank 0, in x")
    assert (named.where, named.message) == ("/runs/a/metrics.jsonl", "No space left on device (rank 0, in x)")
    assert named.fix == "free space there, or choose a path on another filesystem"
    unnamed = path_problem(OSError(errno.EDQUOT, os.strerror(errno.EDQUOT)))
    assert unnamed.where == "" and "quota" in unnamed.fix
    moved = path_problem(OSError(errno.EACCES, "Permission denied", "/a", None, "/b"))
    assert moved.where == "/a -> /b" and "permissions" in moved.fix


@pytest.mark.parametrize("error", [OSError(errno.EACCES, "Permission denied"), OSError(errno.EIO, "I/O error", "/x"),
                                   ValueError("not an OSError")])
def test_errors_that_name_no_path_of_the_users_or_are_not_theirs_keep_their_traceback(error):
    assert path_problem(error) is None


def test_a_full_disk_with_no_file_named_says_the_free_space_where_the_run_writes(tmp_path, monkeypatch):
    monkeypatch.setattr(lifetime.WHEREABOUTS, "folders", (tmp_path, tmp_path / "gone"))
    said = lifetime.free_space(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
    assert said.startswith(f"; free space: {tmp_path} ") and said.endswith(" MiB") and "gone" not in said
    assert lifetime.free_space(OSError(errno.ENOSPC, "No space left on device", "/named")) == ""


def test_the_metrics_file_names_itself_when_its_disk_fills(tmp_path, monkeypatch):
    """Its rows are appended to an open file, whose write() names no file; a resume drops a row cut short."""
    class FullDisk:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def write(self, text):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    writer = MetricsWriter(SimpleNamespace(is_main_process=True, trackers=[]), tmp_path / "metrics.jsonl")
    monkeypatch.setattr(Path, "open", lambda self, mode="r", *a, **k: FullDisk())
    with pytest.raises(OSError) as raised:
        writer.write(StartupRow(step=1, time_to_first_step_s=1.0))
    assert raised.value.filename == str(tmp_path / "metrics.jsonl") and raised.value.errno == errno.ENOSPC
