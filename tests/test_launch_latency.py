"""A launch spends no time on nothing: a rank waiting for another learns promptly that the stage is done, the ranks
load a tokenizer that needs no building at once, and a command that imported torch exits without the collector's
passes over its modules. Times themselves are measured by commands (docs/PERFORMANCE.md), not by these tests: these
hold the mechanisms."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
from conftest import REPO

from accel_fsdp.train import waiting


class FakeClock:
    """time.monotonic and time.sleep of the waiting module, without waiting."""

    def __init__(self):
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


class StoreDoneAt:
    """The process group's store as a waiting rank sees it: the last rank arrives at `done_at` seconds."""

    def __init__(self, clock: FakeClock, done_at: float):
        self.clock, self.done_at, self.counts = clock, done_at, {}

    def add(self, key: str, amount: int) -> int:
        self.counts[key] = self.counts.get(key, 0) + amount
        return self.counts[key]

    def set(self, key: str, value: str) -> None:
        self.counts[key] = 1

    def check(self, keys: list[str]) -> bool:
        return self.clock.now >= self.done_at


@pytest.mark.parametrize("done_at", [0.3, 1.0, 4.0, 9.0, 60.0])
def test_a_waiting_rank_learns_that_the_stage_is_done_within_a_twentieth_of_its_wait(monkeypatch, done_at):
    """The first rank loading a tokenizer for 4 s made the waiting rank up to 2 s late (looks spaced 1.5 times
    further apart each, up to 2 s), and the first rank then waited for it at the next collective."""
    import torch.distributed.distributed_c10d as c10d

    clock = FakeClock()
    monkeypatch.setattr(waiting, "time", SimpleNamespace(monotonic=clock.monotonic, sleep=clock.sleep))
    monkeypatch.setattr(c10d, "_get_default_store", lambda: StoreDoneAt(clock, done_at))
    accelerator = SimpleNamespace(num_processes=2, process_index=1, is_main_process=False)
    waiting.wait_for_every_rank(accelerator, "tokenizer", "build the tokenizer", None)
    late = clock.now - done_at
    assert 0 <= late <= max(waiting.POLL_MIN_S, done_at * waiting.POLL_LATE_FRACTION) + 1e-9, late


@pytest.mark.parametrize("tokenizer, trust_remote_code, once", [
    ("builtin:quickstart", False, False), ("LOCAL", False, False), ("LOCAL", True, True), ("bpe:512", False, True),
    ("gpt2", False, True)])
def test_only_a_tokenizer_that_writes_a_cache_is_made_by_one_rank_while_the_others_wait(
        tmp_path, tokenizer, trust_remote_code, once):
    from accel_fsdp.model.tokenizer import built_once_per_machine

    source = str(tmp_path) if tokenizer == "LOCAL" else tokenizer
    recipe = SimpleNamespace(model=SimpleNamespace(tokenizer=source, name_or_path="gpt2",
                                                   trust_remote_code=trust_remote_code))
    assert built_once_per_machine(recipe) is once


def test_a_command_that_imported_torch_freezes_the_collector_before_the_interpreter_tears_down():
    """Py_FinalizeEx runs the exit callbacks, then collects while it clears the modules: 1.5-2.5 s after the work of
    a process that imported torch, paid by every launch and every check. Frozen objects are skipped there."""
    code = ("import atexit, gc, accel_fsdp.cli, torch; assert gc.get_freeze_count() == 0; "
            "atexit._run_exitfuncs(); print(gc.get_freeze_count())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True).stdout
    assert int(out) > 100_000  # torch's objects among them


def test_a_machine_started_before_the_main_one_launches_promptly_once_the_main_one_listens(monkeypatch):
    """The main machine's ranks wait at the rendezvous for as long as another machine's launcher is late to notice
    that the main process came up (a second, with a look every second)."""
    import contextlib

    from accel_fsdp.launch import launcher

    clock, up_at = FakeClock(), 1.3

    def connect(address, timeout):
        if clock.now < up_at:
            raise ConnectionRefusedError(111, "Connection refused")
        return contextlib.nullcontext()

    monkeypatch.setattr(launcher, "time", SimpleNamespace(monotonic=clock.monotonic, sleep=clock.sleep))
    monkeypatch.setattr(launcher.socket, "create_connection", connect)
    launcher.wait_for_main("10.0.0.1", 29500, timeout=300)
    assert 0 <= clock.now - up_at <= 0.25 + 1e-9, clock.now


@pytest.mark.slow
def test_a_tokenizer_mistake_every_rank_finds_at_once_is_said_once(tmp_path, tiny_gpt2, stories):
    """Every rank loads a local folder's tokenizer at once (no rank waits for another): under a launcher that is not
    ours, which preflight does not run before, both ranks find the missing files, and the user reads it once."""
    import shutil

    from conftest import stock_accelerate_launch, tiny_recipe

    model = shutil.copytree(tiny_gpt2, tmp_path / "model")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (model / name).unlink(missing_ok=True)
    recipe = tiny_recipe(tmp_path / "r.yaml", model, stories)
    proc = stock_accelerate_launch(recipe, tmp_path / "run", timeout=300)
    assert proc.returncode != 0
    assert proc.stderr.count("has no tokenizer files") == 1, proc.stderr[-4000:]
