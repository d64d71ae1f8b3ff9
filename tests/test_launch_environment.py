"""What a user's shell leaves exported around a launch: OMP_NUM_THREADS that is no number (or too many threads for
the cores), a rank's environment only in part. Each works, or is one message naming the variable and the fix."""

from __future__ import annotations

import os

import pytest

from accel_fsdp import hardware
from accel_fsdp.errors import UserError
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


# ------------------------------------------------------------------------------ the address the ranks meet at

def _launch(monkeypatch, tmp_path, **values):
    """`launcher.launch` of a CPU config with these values, Accelerate's launch replaced: the arguments it got, and
    the environment the ranks would inherit."""
    import os

    import accelerate.commands.launch as accelerate_launch

    from accel_fsdp.config.accelerate import load_accelerate_config
    from accel_fsdp.launch import launcher
    from conftest import cpu_config

    seen = []
    monkeypatch.setattr(accelerate_launch, "launch_command", lambda args: seen.append((args, dict(os.environ))))
    saved = dict(os.environ)
    try:
        config = load_accelerate_config(cpu_config(tmp_path / "c.yaml", **values))
        assert launcher.launch(config, ["recipe", "run", "quickstart"]) == 0
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return seen


@pytest.fixture
def held_port():
    """A port another process of this machine listens on."""
    import socket

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        yield listener.getsockname()[1]


def test_a_busy_port_on_one_machine_is_a_note_and_a_free_port(monkeypatch, tmp_path, capsys, held_port):
    """Accelerate picked another port itself, with a two-line UserWarning quoting its source."""
    ((args, _),) = _launch(monkeypatch, tmp_path, main_process_port=held_port)
    assert int(args.main_process_port) == 0
    err = capsys.readouterr().err
    assert f"note: {tmp_path / 'c.yaml'}: main_process_port {held_port} is in use by another process" in err
    assert "UserWarning" not in err


def test_a_busy_port_on_the_main_machine_of_several_is_one_message(monkeypatch, tmp_path, held_port):
    """Accelerate raised ConnectionError from its launcher: a traceback."""
    with pytest.raises(UserError, match=rf"(?s)main_process_port {held_port}: is in use by another process on this "
                                        r"machine .* fix: choose another port, the same on every machine"):
        _launch(monkeypatch, tmp_path, num_machines=2, num_processes=2, main_process_ip="127.0.0.1",
                main_process_port=held_port, machine_rank=0)


@pytest.mark.parametrize("machine_rank", [0, 1])
def test_a_main_process_address_that_does_not_resolve_is_one_message_at_once(monkeypatch, tmp_path, machine_rank):
    """Rank 0 waited out the whole rendezvous timeout (a C++ stack per retry) and blamed the machines that did not
    join; rank 1 waited it out too before it said the name does not resolve."""
    with pytest.raises(UserError, match=r"(?s)main_process_ip no.such.host.invalid: does not resolve to an address .* "
                                        r"fix: give the IP address of the machine with machine_rank 0"):
        _launch(monkeypatch, tmp_path, num_machines=2, num_processes=2, main_process_ip="no.such.host.invalid",
                main_process_port=29500, machine_rank=machine_rank)


def test_accelerate_and_fsdp_variables_left_in_the_shell_do_not_reach_the_ranks(monkeypatch, tmp_path, capsys):
    """ACCELERATE_USE_DEEPSPEED=true made every rank ask for DeepSpeed (a traceback each); an FSDP_* key the config
    leaves out reached Accelerate's plugin. The config and the recipe decide; a note says what was left out."""
    for name in [n for n in os.environ if n.startswith(("ACCELERATE_", "FSDP_"))]:  # an earlier in-process test's
        monkeypatch.delenv(name)  # (accelerate's fsdp_utils sets FSDP_CPU_RAM_EFFICIENT_LOADING in the process)
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("FSDP_ACTIVATION_CHECKPOINTING", "true")
    monkeypatch.setenv("ACCELERATE_LOG_LEVEL", "info")  # the user's to set
    ((_, at_launch),) = _launch(monkeypatch, tmp_path)
    assert "ACCELERATE_USE_DEEPSPEED" not in at_launch and "FSDP_ACTIVATION_CHECKPOINTING" not in at_launch
    assert at_launch["ACCELERATE_LOG_LEVEL"] == "info"
    assert ("note: ACCELERATE_USE_DEEPSPEED=true, FSDP_ACTIVATION_CHECKPOINTING=true exported in this shell are left "
            "out of the launch: the accelerate config and the recipe decide") in capsys.readouterr().err
