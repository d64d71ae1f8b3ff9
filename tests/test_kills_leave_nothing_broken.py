"""A command killed at any instant (SIGKILL: no cleanup runs), or stopped by a full disk, leaves each output it writes
whole or absent (on a full disk, the previous one as it was), no temporary that stays for ever, and a rerun of the same
command that works. The writers live in accel_fsdp/files.py (write_with, atomic_folder, discard_folder, failing_write);
these tests kill or fill under them, and under the one-process commands that write through them.

A full disk is simulated where the kernel reports it late, at the fsync before the rename (NFS, and ext4's delayed
allocation, report ENOSPC there), or by the exception a Rust writer raises (safetensors, tokenizers), with the text
those libraries give it (safetensors 0.8 `save_file` on a full tmpfs, checked here)."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import REPO, run_in_process, write_jsonl
from safetensors import SafetensorError

from accel_fsdp import files
from accel_fsdp.cli import main

FULL = "No space left on device"


def killed_inside(code: str) -> None:
    """Run `code` in a fresh interpreter that kills itself (SIGKILL) where the code says."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == -signal.SIGKILL, f"status {proc.returncode}\n{proc.stderr[-3000:]}"


def no_room(path) -> None:
    """files._fsync_file on a full disk."""
    raise OSError(errno.ENOSPC, FULL)


def test_a_file_writer_killed_half_way_leaves_a_temporary_that_the_next_write_removes(tmp_path):
    target = tmp_path / "table.bin"
    killed_inside(f"""
        import os, signal
        from accel_fsdp import files
        def half(temporary):
            temporary.write_bytes(b"half")
            os.kill(os.getpid(), signal.SIGKILL)
        files.write_with({str(target)!r}, half)
    """)
    assert not target.exists() and len(files.temporaries_of(target)) == 1  # what the kill left
    files.write_atomic(target, b"whole")
    assert target.read_bytes() == b"whole" and not files.temporaries_of(target)
    assert [p.name for p in tmp_path.iterdir()] == ["table.bin"]


def test_a_folder_builder_killed_half_way_leaves_a_temporary_that_the_next_build_removes(tmp_path):
    folder = tmp_path / "tokenizer"
    killed_inside(f"""
        import os, signal
        from accel_fsdp import files
        with files.atomic_folder({str(folder)!r}) as building:
            (building / "tokenizer.json").write_text("{{half")
            os.kill(os.getpid(), signal.SIGKILL)
    """)
    assert not folder.exists() and len(files.temporaries_of(folder)) == 1
    with files.atomic_folder(folder) as building:
        (building / "tokenizer.json").write_text("{}")
    assert [p.name for p in tmp_path.iterdir()] == ["tokenizer"]


def exchange_works_here(folder) -> bool:
    """What this filesystem can do: swap two entries in one step (RENAME_EXCHANGE), or not (then two renames)."""
    probe_a, probe_b = folder / "a", folder / "b"
    for probe in (probe_a, probe_b):
        probe.mkdir()
    works = files.exchange(probe_a, probe_b)
    for probe in (probe_a, probe_b):
        probe.rmdir()
    return works


@pytest.mark.parametrize("how", ["as this filesystem can", "two renames"])
def test_a_folder_replaced_by_a_process_killed_while_publishing_is_the_old_or_the_new_one(tmp_path, how):
    """Killed at the worst instant of the replacing: right after the old folder was moved. Where the filesystem
    exchanges entries in one step (Linux's local filesystems), `path` is the old folder or the new one. With two
    renames (NFS, macOS; forced here by the second case) it is the old one or none, never a mix, and whatever the kill
    left is swept by the next writer."""
    folder = tmp_path / "export"
    with files.atomic_folder(folder) as building:
        (building / "weights").write_text("old")
    two_renames = how == "two renames" or not exchange_works_here(tmp_path)
    killed_or_done = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        import os, signal
        from accel_fsdp import files
        if {two_renames!r}:
            files.exchange = lambda a, b: False
        rename = os.rename
        def rename_then_die(source, target):
            rename(source, target)
            if str(source) == {str(folder)!r}:  # the old folder was moved aside: the next rename would publish
                os.kill(os.getpid(), signal.SIGKILL)
        os.rename = rename_then_die
        with files.atomic_folder({str(folder)!r}) as building:
            (building / "weights").write_text("new")
    """)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert killed_or_done.returncode in (0, -signal.SIGKILL), killed_or_done.stderr[-3000:]
    if two_renames:
        assert killed_or_done.returncode == -signal.SIGKILL  # the fallback went through the instant it is killed at
        assert not folder.exists() or (folder / "weights").read_text() == "old"
    else:
        assert (folder / "weights").read_text() in ("old", "new")
    with files.atomic_folder(folder) as building:  # and the next writer sweeps whatever the kill left
        (building / "weights").write_text("newer")
    assert [p.name for p in tmp_path.iterdir()] == ["export"]


def test_only_linux_is_asked_to_exchange(tmp_path, monkeypatch):
    """renameat2 is Linux's: elsewhere (macOS) the exchange is not tried, and publishing uses two renames."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.setattr(sys, "platform", "darwin")
    assert files.exchange(tmp_path / "a", tmp_path / "b") is False
    with files.atomic_folder(tmp_path / "b") as building:
        (building / "weights").write_text("new")
    assert (tmp_path / "b" / "weights").read_text() == "new"


WRITER_ERRORS = {
    "safetensors": lambda: SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)"),
    "tokenizers": lambda: Exception("No space left on device (os error 28)"),  # Tokenizer.save
    "python": lambda: OSError(errno.ENOSPC, FULL),  # write(): no file name
}


@pytest.mark.parametrize("writer", sorted(WRITER_ERRORS))
def test_a_full_disk_under_a_writer_is_an_os_error_naming_the_output(tmp_path, writer):
    def fail(*_):
        raise WRITER_ERRORS[writer]()

    out = tmp_path / "export"
    with files.atomic_folder(out) as building:
        (building / "old").write_text("the previous export")
    with pytest.raises(OSError) as caught:
        with files.atomic_folder(out) as building:
            (building / "new").write_text("half")
            fail()
    assert caught.value.errno == errno.ENOSPC and caught.value.filename == str(out)
    assert [p.name for p in out.iterdir()] == ["old"] and not files.temporaries_of(out)
    with pytest.raises(OSError) as caught:
        files.write_with(tmp_path / "job.sbatch", fail)
    assert caught.value.errno == errno.ENOSPC and caught.value.filename == str(tmp_path / "job.sbatch")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]
    with pytest.raises(ValueError, match="a bug of ours"):  # any other error goes on as it was
        with files.atomic_folder(out):
            raise ValueError("a bug of ours, not a full disk")


def test_the_rust_writers_say_an_os_error_as_files_reads_it(tmp_path):
    """safetensors' and tokenizers' own exceptions for an OS error, as they are today (a missing folder stands in for
    a full disk: the same Rust io::Error, another code), read by failing_write as that OS error."""
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models

    writers = {"safetensors": lambda target: save_file({"w": torch.zeros(2)}, str(target)),
               "tokenizers": lambda target: Tokenizer(models.BPE()).save(str(target))}
    for name, write in writers.items():
        out = tmp_path / name
        with pytest.raises(OSError) as caught:
            with files.atomic_folder(out) as building:
                write(building / "no-such-folder" / "file")
        assert caught.value.errno == errno.ENOENT and caught.value.filename == str(out), name
    assert not list(tmp_path.iterdir())


def test_slurm_on_a_full_disk_names_the_script_and_keeps_the_previous_one(tmp_path, monkeypatch):
    script = tmp_path / "job.sbatch"
    run_in_process("slurm", "quickstart", "--nodes", "1", "--gpus-per-node", "2", "-o", script, check=0)
    before = script.read_text()
    with monkeypatch.context() as patch:
        patch.setattr(files, "_fsync_file", no_room)
        err = run_in_process("slurm", "quickstart", "--nodes", "2", "--gpus-per-node", "2", "-o", script,
                             check=2).stderr
    assert f"{script}: {FULL}" in err and "free space there" in err and "Traceback" not in err
    assert script.read_text() == before and [p.name for p in tmp_path.iterdir()] == ["job.sbatch"]


def test_data_prepare_on_a_full_disk_names_the_cache_entry_and_the_rerun_builds_it(tmp_path, monkeypatch):
    data = write_jsonl(tmp_path / "own.jsonl", [{"text": f"story {i}: " + "alice has a cat. " * (i % 7 + 1)}
                                               for i in range(1500)])
    with monkeypatch.context() as patch:
        patch.setattr(files, "_fsync_file", no_room)
        err = run_in_process("data", "prepare", "quickstart", "--set", f"data.path={data}", check=2).stderr
    assert f"{FULL}" in err and "free space there" in err and "Traceback" not in err
    entry = err.split("error: ")[1].split(":")[0]
    assert "/tokenized/" in entry and ".tmp-" not in entry
    tokenized = os.path.dirname(entry)
    assert not [n for n in os.listdir(tokenized) if files.TMP_MARK in n]  # nothing half-written stays
    out = run_in_process("data", "prepare", "quickstart", "--set", f"data.path={data}", check=0).stdout
    assert entry in out


def test_tokenizer_train_run_again_replaces_its_own_earlier_folder(tmp_path):
    """A rerun after a kill that came just after the folder was published (or after a finished run)."""
    data = write_jsonl(tmp_path / "own.jsonl", [{"text": f"tale {i} of a cat and a dog"} for i in range(600)])
    out = tmp_path / "tok"
    for _ in range(2):
        result = CliRunner().invoke(main, ["tokenizer", "train", "quickstart", str(out), "--vocab-size", "300",
                                           "--set", f"data.path={data}"])
        assert result.exit_code == 0, result.output
    assert (out / "tokenizer.json").is_file() and [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == []


def test_verify_killed_while_discarding_its_earlier_folder_can_run_again(tmp_path):
    """An earlier verify folder is replaced by a new verify; one killed while deleting it must not leave a folder
    without its marker (which the next verify would refuse as someone else's)."""
    from accel_fsdp.tools.verify_runs import MARKER, claim_folder

    out = tmp_path / "quickstart-verify"
    claim_folder(out)
    for k in range(40):  # probes' files: the marker is rarely the last one deleted
        (out / f"probe-{k:02d}.out").write_text("x")
    killed_inside(f"""
        import os, signal
        from pathlib import Path
        from accel_fsdp.tools.verify_runs import claim_folder
        unlink = os.unlink
        def unlink_then_die(path, *args, **kwargs):
            unlink(path, *args, **kwargs)
            if os.path.basename(path) == {MARKER!r}:
                os.kill(os.getpid(), signal.SIGKILL)
        os.unlink = unlink_then_die
        claim_folder(Path({str(out)!r}))
    """)
    claim_folder(out)
    assert [p.name for p in out.iterdir()] == [MARKER] and [p.name for p in tmp_path.iterdir()] == [out.name]


def test_a_report_stopped_while_drawing_keeps_the_previous_loss_curve(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text(json.dumps({"run_id": "0123456789abcdef", "recipe_name": "demo"}))
    rows = [{"kind": "train", "step": s, "loss": 5.0 - 0.4 * s, "tokens_per_s": 1000.0, "tokens_per_s_per_rank": 500.0,
             "step_time_s": 0.1, "tokens_seen": 100 * s, "peak_memory_bytes": [10 << 20]} for s in range(1, 6)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert CliRunner().invoke(main, ["report", str(run)]).exit_code == 0
    png = (run / "loss_curve.png").read_bytes()

    def half_then_ctrl_c(self, target, **kwargs):
        with open(target, "wb") as f:
            f.write(png[:100])
        raise KeyboardInterrupt

    monkeypatch.setattr(Figure, "savefig", half_then_ctrl_c)
    stopped = CliRunner().invoke(main, ["report", str(run)])
    assert_ctrl_c_said_once(stopped)
    assert (run / "loss_curve.png").read_bytes() == png and not files.temporaries_of(run / "loss_curve.png")


def assert_ctrl_c_said_once(result) -> None:
    """A command Ctrl-C stopped (in-process, CliRunner): status 130, as a shell reports it, and one line saying so,
    not click's "Aborted!" with status 1."""
    assert result.exit_code == 130, (result.exit_code, result.output)
    assert result.stderr.strip().endswith("interrupted (Ctrl-C); nothing half-written was left: run the same command "
                                          "again"), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Aborted" not in result.output, result.output


def test_tokenizer_train_stopped_by_ctrl_c_keeps_its_earlier_folder_and_says_so_in_one_line(tmp_path, monkeypatch):
    """Ctrl-C while the trained tokenizer is being saved: the folder of the earlier run stays whole, no temporary
    stays, one line and status 130; the same command then runs."""
    from transformers import PreTrainedTokenizerFast

    data = write_jsonl(tmp_path / "own.jsonl", [{"text": f"tale {i} of a cat and a dog"} for i in range(600)])
    out = tmp_path / "tok"
    command = ["tokenizer", "train", "quickstart", str(out), "--vocab-size", "300", "--set", f"data.path={data}"]
    assert CliRunner().invoke(main, command).exit_code == 0
    before = (out / "tokenizer.json").read_bytes()

    def half_then_ctrl_c(self, folder, *args, **kwargs):
        (Path(folder) / "tokenizer.json").write_text("{half")
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(PreTrainedTokenizerFast, "save_pretrained", half_then_ctrl_c)
        assert_ctrl_c_said_once(CliRunner().invoke(main, command))
    assert (out / "tokenizer.json").read_bytes() == before
    assert [p.name for p in tmp_path.iterdir() if files.TMP_MARK in p.name] == []
    assert CliRunner().invoke(main, command).exit_code == 0


@pytest.mark.slow
def test_a_full_disk_during_the_final_export_names_it_and_the_command_that_writes_it_later(tmp_path, tiny_gpt2,
                                                                                          stories, monkeypatch):
    """The run's export (checkpoint.export_final) meets a full disk after its weights are written: one message naming
    the folder and the command that writes it later (an earlier export stays whole: atomic_folder, above); no
    temporary remains, and that command then writes it."""
    from conftest import run_cli, tiny_recipe

    recipe = tiny_recipe(tmp_path / "recipe.yaml", tiny_gpt2, stories, training={"max_steps": 2},
                         checkpoint={"keep_last": None, "export_dtype": "fp32"})
    run = tmp_path / "run"
    err = run_cli("recipe", "run", recipe, "--output-dir", run, env={"ACCEL_FSDP_FAULT": "enospc-in-export:2"},
                  check=2).stderr
    assert f"{run / 'final'}: exporting step-000002 failed: {FULL}" in err and "Traceback" not in err
    assert f"checkpoint consolidate {run} {run / 'final'}" in err
    assert not (run / "final").exists() and not [p.name for p in run.iterdir() if files.TMP_MARK in p.name]
    import safetensors.torch

    with monkeypatch.context() as patch:  # the command itself on a full disk: safetensors' own error
        patch.setattr(safetensors.torch, "save_file", lambda *a, **k: (_ for _ in ()).throw(
            WRITER_ERRORS["safetensors"]()))
        err = run_in_process("checkpoint", "consolidate", run, run / "final", check=2).stderr
    assert f"{run / 'final'}: {FULL}" in err and "free space there" in err and "Traceback" not in err
    assert not (run / "final").exists() and not [p.name for p in run.iterdir() if files.TMP_MARK in p.name]
    run_in_process("checkpoint", "consolidate", run, run / "final", check=0)
    assert (run / "final" / "model.safetensors").is_file()


def processes_naming(text: str) -> list[int]:
    """PIDs of the live processes whose command line holds `text`."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if text.encode() in f.read():
                    found.append(int(entry))
        except (OSError, ValueError):
            continue
    return found


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_run_started_by_a_killed_command_dies_with_it(tmp_path, tiny_gpt2, stories):
    """verify's probes and bench's runs are `recipe run`s it starts: a verify killed (SIGKILL) takes them with it, so
    its rerun never shares a probe folder with an orphan of the first still training into it."""
    import time

    from conftest import tiny_recipe

    recipe = tiny_recipe(tmp_path / "recipe.yaml", tiny_gpt2, stories, training={"max_steps": 100_000})
    run = tmp_path / "probe"
    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import os, subprocess, sys
        from accel_fsdp.train.lifetime import tied_to_this_process
        subprocess.run([sys.executable, "-m", "accel_fsdp", "recipe", "run", {str(recipe)!r}, "--output-dir",
                        {str(run)!r}, "--num-processes", "1"], env=tied_to_this_process(dict(os.environ)))
    """)], cwd=REPO)
    deadline = time.monotonic() + 240
    while not (run / "metrics.jsonl").exists() and time.monotonic() < deadline and parent.poll() is None:
        time.sleep(0.5)
    assert (run / "metrics.jsonl").exists(), "the run never started training"
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 30
    while processes_naming(str(run)) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = processes_naming(str(run))
    for pid in left:  # the test's own cleanup of what it found, before it fails
        os.kill(pid, signal.SIGKILL)
    assert not left, f"still running after their parent was killed: {left}"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_run_whose_command_was_killed_while_it_started_ends_at_once(tmp_path):
    """The command (verify, bench) killed while the `recipe run` it started was still importing: that run's parent is
    init by the time it asks the kernel for the parent-death signal, which would then never come, and it trained on
    alone into the folder the command's rerun uses. It finds the parent it was given gone, and ends."""
    run = tmp_path / "probe"
    parent = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        import os, signal, subprocess, sys
        from accel_fsdp.train.lifetime import tied_to_this_process
        subprocess.Popen([sys.executable, "-m", "accel_fsdp", "recipe", "run", "quickstart", "--output-dir",
                          {str(run)!r}, "--num-processes", "1"], env=tied_to_this_process(dict(os.environ)))
        os.kill(os.getpid(), signal.SIGKILL)  # before the child is past its imports
    """)], cwd=REPO, timeout=60)
    assert parent.returncode == -signal.SIGKILL
    import time

    deadline = time.monotonic() + 120  # the child's imports, on a busy machine
    while processes_naming(str(run)) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = processes_naming(str(run))
    for pid in left:  # the test's own cleanup of what it found, before it fails
        os.kill(pid, signal.SIGKILL)
    assert not left and not run.exists(), f"still running, or started the run, after their parent was killed: {left}"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl")
def test_a_rank_whose_launcher_is_gone_before_it_started_ends_at_once(tmp_path):
    """A rank our launcher started, the launcher killed (SIGKILL) before the rank asked for the parent-death signal:
    its parent is no longer the PID the launcher gave it, and it ends at once instead of training alone."""
    from accel_fsdp.train.lifetime import LAUNCHER_PID_ENV

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a PID that is nobody's parent now
    rank = subprocess.run([sys.executable, "-m", "accel_fsdp", "recipe", "run", "quickstart", "--output-dir",
                           str(tmp_path / "run")], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "1",
                               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1", LAUNCHER_PID_ENV: str(gone.pid)})
    assert rank.returncode == -signal.SIGKILL, (rank.returncode, rank.stderr[-3000:])
    assert not (tmp_path / "run").exists()
