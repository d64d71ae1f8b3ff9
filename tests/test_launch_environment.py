"""What a user's shell leaves exported around a launch: OMP_NUM_THREADS that is no number (or too many threads for
the cores), a rank's environment only in part. Each works, or is one message naming the variable and the fix."""

from __future__ import annotations

import pytest

from accel_fsdp import hardware
from accel_fsdp.hardware import oversubscribed_cores_note, settle_thread_environment
from conftest import cli, user_error


@pytest.mark.parametrize("value", ["abc", "0", "-1", "1.5"])
def test_omp_num_threads_that_is_no_positive_number_is_one_message(monkeypatch, value):
    """Accelerate's launcher read it with int() (a ValueError traceback for 'abc'); libgomp said 'Invalid value'."""
    monkeypatch.setenv("OMP_NUM_THREADS", value)
    out = user_error("recipe", "validate", "quickstart")
    assert f"error: OMP_NUM_THREADS: {value!r} is not a positive whole number of threads" in out
    assert "fix: export OMP_NUM_THREADS=<threads per process>, e.g. 1, or unset it" in out


def test_omp_num_threads_exported_empty_is_as_unset():
    env = {"OMP_NUM_THREADS": " "}
    settle_thread_environment(env)
    assert env == {}
    env = {"OMP_NUM_THREADS": "4"}
    settle_thread_environment(env)
    assert env == {"OMP_NUM_THREADS": "4"}


def test_more_threads_than_cores_for_the_cpu_ranks_is_a_note(monkeypatch):
    monkeypatch.setattr(hardware, "usable_cores", lambda: 4)
    note = oversubscribed_cores_note({"OMP_NUM_THREADS": "1000"}, 2)
    assert note.startswith("OMP_NUM_THREADS=1000 gives each of this machine's 2 CPU rank(s) 1000 thread(s): 2000 on 4")
    assert "unset it (each rank then gets 2)" in note
    assert oversubscribed_cores_note({"OMP_NUM_THREADS": "2"}, 2) is None
    assert oversubscribed_cores_note({}, 2) is None


def test_a_ranks_environment_left_over_in_part_is_one_message(monkeypatch):
    """LOCAL_RANK and WORLD_SIZE exported by another launch made `recipe run` train as a rank whose process group
    never meets (Accelerate's MASTER_ADDR traceback); every command now says what is left over."""
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    for name in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    out = user_error("recipe", "validate", "quickstart")
    assert ("error: LOCAL_RANK=0, WORLD_SIZE=2: a rank's environment only in part (RANK, MASTER_ADDR, MASTER_PORT "
            "not set)") in out
    assert "fix: unset LOCAL_RANK WORLD_SIZE" in out
    monkeypatch.delenv("LOCAL_RANK")
    assert cli("recipe", "validate", "quickstart")[0] == 0
