"""A signal that comes in a phase other than the training steps gets the answer README promises for it: SIGTERM and
SIGUSR1 (a preemption) end a `recipe run` with 75 and one line saying to continue with `--resume auto`, Ctrl-C (SIGINT)
with 130 and one line, whichever process it reaches (the launcher still checking, or one rank alone). The training
steps' own answers, and a rank's start, are held by tests/test_checkpoint.py; the one-process commands' Ctrl-C by
tests/test_kills_leave_nothing_broken.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
from conftest import REPO

from accel_fsdp import files
from accel_fsdp.config.accelerate import AccelerateConfig
from accel_fsdp.launch import launcher
from accel_fsdp.launch.launcher import RankRecords


@pytest.mark.parametrize("name", ["SIGTERM", "SIGUSR1"])
def test_a_preemption_while_the_launcher_checks_the_run_ends_it_with_75_and_one_line(tmp_path, name):
    """The checks before a launch (the recipe, the data, the run folder) can take minutes; a preemption then, before
    torchrun's agent handles the signals, must not end the launcher by the signal's default action (143 or 138, which a
    requeueing script does not take for a preemption), nor leave anything half-written."""
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        import os, signal
        from accel_fsdp.cli import main, recipe
        def preempted_while_checking(*args, **kwargs):
            os.kill(os.getpid(), signal.{name})
            raise AssertionError("the signal was not answered")
        recipe.preflight = preempted_while_checking
        main(["recipe", "run", "quickstart", "--output-dir", {str(out)!r}])
    """)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 75, (proc.returncode, proc.stderr[-3000:])
    assert proc.stderr == f"preempted ({name}). Continue with the same command and --resume auto.\n"
    assert not out.exists()


def test_ctrl_c_to_one_rank_alone_ends_the_run_with_130_and_one_line(tmp_path, monkeypatch, capsys):
    """SIGINT to one rank (`kill -INT`): it ends with 130 at once (train/lifetime.py run_rank), the others follow it
    (PEER_FAILED, 3); the launcher says it was interrupted and how to continue, with 130, not "rank 1 exited with
    status 130" and 1."""
    import accelerate.commands.launch

    class ChildFailed(Exception):  # what torchrun's agent raises: the failed ranks and their exit statuses
        def __init__(self):
            super().__init__("ranks failed")
            self.failures = {0: SimpleNamespace(exitcode=launcher.PEER_FAILED), 1: SimpleNamespace(exitcode=130)}

    def ranks_that_failed(parsed):
        raise ChildFailed()

    monkeypatch.setattr(accelerate.commands.launch, "launch_command", ranks_that_failed)
    config = AccelerateConfig(values={}, label="a config of defaults")
    status = launcher._launch(None, config, launcher.MachineOptions(), tmp_path, RankRecords(None), range(2))
    assert status == 128 + signal.SIGINT
    assert capsys.readouterr().err == ("interrupted (SIGINT to rank 1): the ranks were stopped. Continue with the same "
                                       "command and --resume auto (from the newest complete checkpoint, if any).\n")


def test_ranks_ended_by_a_preemption_signal_before_they_could_answer_it_are_a_preemption():
    """What each rank's exit status says about the run (train/lifetime.py): a preemption when every rank checkpointed
    (75) or was ended by SIGTERM or SIGUSR1 itself (in its start) or stopped after a peer left (3); anything else is
    not one."""
    term, usr1 = -signal.SIGTERM.value, -signal.SIGUSR1.value
    assert launcher.preemption_of_ranks({0: 75, 1: 75}) == ""  # checkpointed: the marker names the signal
    assert launcher.preemption_of_ranks({0: 3, 1: 75}) == ""
    assert launcher.preemption_of_ranks({0: term, 1: usr1}) == "SIGTERM to rank 0, SIGUSR1 to rank 1"
    assert launcher.preemption_of_ranks({0: 3, 1: usr1, 2: usr1}) == "SIGUSR1 to ranks 1 and 2"
    for not_one in ({0: 3, 1: 3}, {0: term, 1: 1}, {0: -signal.SIGKILL.value, 1: 75}, {0: 2, 1: term}):
        assert launcher.preemption_of_ranks(not_one) is None, not_one


ONE_PROCESS_COMMANDS = {
    # command, the function its writer calls (replaced by one that writes half, then gets the signal)
    "tokenizer train": (["tokenizer", "train", "quickstart", "{out}", "--vocab-size", "300", "--set",
                         "data.path={data}"], "transformers.PreTrainedTokenizerFast", "save_pretrained"),
    "data prepare": (["data", "prepare", "quickstart", "--set", "data.path={data}"], "accel_fsdp.data.prepare",
                     "build_source"),
}


@pytest.mark.parametrize("name", ["SIGTERM", "SIGUSR1"])
@pytest.mark.parametrize("command", sorted(ONE_PROCESS_COMMANDS))
def test_a_preemption_of_a_one_process_command_leaves_nothing_half_written_and_says_so(tmp_path, command, name):
    """A scheduler's SIGTERM (or SLURM's SIGUSR1) to `data prepare` or `tokenizer train` in the middle of its writing:
    one line and 75, and what it had half-written removed (the signal's default action ended it where it was: no
    word, status 143 or 138, a temporary left behind); the same command then runs."""
    from conftest import write_jsonl

    data = write_jsonl(tmp_path / "own.jsonl", [{"text": f"tale {i} of a cat and a dog"} for i in range(600)])
    out, cache = tmp_path / "out", tmp_path / "cache"
    args, where, function = ONE_PROCESS_COMMANDS[command]
    args = [a.format(out=out, data=data) for a in args]
    module, _, owner = where.rpartition(".") if where.endswith("Fast") else (where, "", "")
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        import importlib, os, signal, pathlib
        from accel_fsdp.cli import main
        holder = importlib.import_module({module!r})
        holder = getattr(holder, {owner!r}) if {owner!r} else holder
        def half_then_signal(*args, **kwargs):
            folder = next(a for a in args if isinstance(a, (str, pathlib.Path)) and os.path.isdir(a))
            pathlib.Path(folder, "half").write_text("half")
            os.kill(os.getpid(), signal.{name})
            raise AssertionError("the signal was not answered")
        setattr(holder, {function!r}, half_then_signal)
        main({args!r})
    """)], cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ, "ACCEL_FSDP_CACHE": str(cache)})
    assert proc.returncode == 75, (proc.returncode, proc.stderr[-3000:])
    said = f" {command}: preempted ({name}); nothing half-written was left: run the same command again\n"
    assert proc.stderr.endswith(said), proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    written = [p for p in (*tmp_path.rglob("*"),) if files.TMP_MARK in p.name or p.name == "half"]
    assert not written, written
    rerun = subprocess.run([sys.executable, "-m", "accel_fsdp", *args], cwd=REPO, capture_output=True, text=True,
                           timeout=300, env={**os.environ, "ACCEL_FSDP_CACHE": str(cache)})
    assert rerun.returncode == 0, rerun.stderr[-3000:]
