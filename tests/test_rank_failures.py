"""One rank ends early, the others are in (or on their way to) a collective: the run ends with one message.

A user's mistake found by one rank alone is said once, with exit status 2, and no other rank adds a traceback; a
rank that stops making progress is named, with where the others waited for it, when the collective timeout passes.
The faults are injected through ACCEL_FSDP_FAULT (train/faults.py), on rank 1 only.
"""

from __future__ import annotations

import pytest
from conftest import WallClockBound, read_metrics, run_cli, run_in_process, stock_accelerate_launch, tiny_recipe

from accel_fsdp.launch.launcher import ended_early, hang_problem
from accel_fsdp.train import lifetime
from accel_fsdp.train.lifetime import (
    INTERRUPTED,
    INTERRUPTED_BY_USER,
    PEER_FAILED,
    STOPPED,
    TIMED_OUT,
    USER_ERROR,
    Preemption,
    RankRecord,
    RankRecords,
)

pytestmark = pytest.mark.multiprocess


def quiet_end(output: str) -> None:
    """Nothing but the one message: no traceback, no rank's gloo error, no preemption taken for the teardown."""
    for noise in ("Traceback", "[rank0]", "[rank1]", "gloo", "SIGTERM", "exited with status", "killed by"):
        assert noise not in output, (noise, output[-3000:])


def test_a_user_error_on_one_rank_ends_the_others_quietly_with_one_message(tmp_path, tiny_gpt2, stories):
    recipe = tiny_recipe(tmp_path / "r.yaml", tiny_gpt2, stories)
    proc = run_cli("recipe", "run", recipe, "--output-dir", tmp_path / "run",
                   env={"ACCEL_FSDP_FAULT": "user-error:2@1"})  # rank 1 alone, while rank 0 goes on to step 3
    assert proc.returncode == 2, proc.stderr[-3000:]
    message = "error: (injected fault): a mistake found by one rank alone after optimizer step 2\n" \
              "    fix: nothing to fix: a test fault"
    assert proc.stderr.count(message) == 1, proc.stderr[-3000:]
    quiet_end(proc.stdout + proc.stderr)


@pytest.mark.slow
def test_under_stock_accelerate_launch_the_rank_that_found_it_says_it(tmp_path, tiny_gpt2, stories):
    """No record folder there: rank 1 says its message itself (it was said by no one: only each machine's first rank
    spoke), rank 0 one line that another rank left, and no traceback of a rank."""
    recipe = tiny_recipe(tmp_path / "r.yaml", tiny_gpt2, stories)
    proc = stock_accelerate_launch(recipe, tmp_path / "run", env={"ACCEL_FSDP_FAULT": "user-error:2@1"}, timeout=600)
    assert proc.returncode != 0
    assert proc.stderr.count("error: (injected fault): a mistake found by one rank alone after optimizer step 2") == 1
    assert "[rank 0] stopped in " in proc.stderr and "another rank left (its output says why)" in proc.stderr
    assert "[rank0]:" not in proc.stderr and "[rank1]:" not in proc.stderr, proc.stderr[-3000:]  # torchrun's tracebacks


@pytest.mark.slow
def test_a_stalled_rank_is_named_with_where_the_others_waited_for_it(tmp_path, tiny_gpt2, stories):
    recipe = tiny_recipe(tmp_path / "r.yaml", tiny_gpt2, stories, fsdp={"collective_timeout_minutes": 0.25})
    run_in_process("data", "prepare", recipe, check=0)  # so the start waits on nothing near the 15 s
    bound = WallClockBound(120)  # 15 s of waiting and a short run: 25 to 28 s here under the parallel suite
    proc = run_cli("recipe", "run", recipe, "--output-dir", tmp_path / "run", env={"ACCEL_FSDP_FAULT": "hang:2@1"})
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "error: rank 1 stopped making progress in the logging, evaluation and checkpoint after optimizer step 2: " \
           "rank 0 waited 15 s (fsdp.collective_timeout_minutes: 0.25) for it there\n    fix: a rank stopped making " \
           "progress" in proc.stderr, proc.stderr[-3000:]
    quiet_end(proc.stdout + proc.stderr.replace("[fault] hanging after optimizer step 2", ""))
    # The stalled rank answered the launcher's SIGTERM at once (torchrun waits 30 s before its SIGKILL).
    bound.check("a run whose rank 1 stalled")


def record(rank: int, why: str, doing: str, message: str = "") -> RankRecord:
    return RankRecord(rank, why, doing, message, 1.0 if why == TIMED_OUT else None)


def test_the_launcher_says_each_user_error_once_and_names_where_ranks_waited(capsys):
    same = "r.yaml: data.path: missing"
    assert ended_early({0: record(0, USER_ERROR, "x", same), 1: record(1, USER_ERROR, "x", same),
                        2: record(2, STOPPED, "y")}, range(4), 1) == 2
    assert capsys.readouterr().err == f"error: {same}\n"
    step = "optimizer step 4 (forward, backward, gradient reduction)"
    # a rank that did not even answer the launcher's SIGTERM: no record of its own
    problem = hang_problem({0: record(0, TIMED_OUT, step), 2: record(2, TIMED_OUT, step)}, range(3), 1)
    assert problem.message.startswith("rank 1 stopped making progress (it did not answer the launcher's SIGTERM")
    assert problem.message.endswith(f"ranks 0 and 2 in {step} waited 1 min (fsdp.collective_timeout_minutes: 1) "
                                    "for it")
    # every rank of this machine waited: the one that stalled is on another machine
    problem = hang_problem({4: record(4, TIMED_OUT, step), 5: record(5, TIMED_OUT, step)}, range(4, 6), 2)
    assert "every rank of this machine waited 1 min" in problem.message and "that machine's output" in problem.message
    # both waited, in different places: they ran different collectives
    problem = hang_problem({0: record(0, TIMED_OUT, step), 1: record(1, TIMED_OUT, "the save of the checkpoint of "
                                                                                   "step 3")}, range(2), 1)
    assert problem.message == (f"the ranks waited 1 min (fsdp.collective_timeout_minutes: 1) for each other in "
                               f"different places (rank 0 in {step}; rank 1 in the save of the checkpoint of step 3): "
                               "they ran different collectives, a bug of accel-fsdp: please report it with this output")


class Left(Exception):
    """`leave(status)`, which ends the process, raised instead."""


def test_ctrl_c_to_one_rank_is_not_taken_for_a_preemption_by_the_ranks_torchrun_then_stops(tmp_path, monkeypatch,
                                                                                          capsys):
    """`kill -INT` to rank 1: it ends (130), torchrun's agent sends SIGTERM to rank 0, whose handler must see that
    another rank ended (its record) and end quietly, not announce a preemption checkpoint above the launcher's
    "interrupted" line. The record was once missing, and whether rank 0 printed the line was a race."""
    def leave(status):
        raise Left(status)

    monkeypatch.setattr(lifetime, "leave", leave)
    monkeypatch.setattr(lifetime, "outlive_closed_output", lambda: None)  # this process's streams stay pytest's
    records = RankRecords(tmp_path)
    monkeypatch.setenv("RANK", "1")

    def interrupted():
        raise KeyboardInterrupt

    with pytest.raises(Left) as left, monkeypatch.context() as env:
        env.setenv(lifetime.RANK_RECORDS_ENV, str(tmp_path))
        lifetime.run_rank(interrupted)
    assert left.value.args == (INTERRUPTED,)
    assert records.read()[1].why == INTERRUPTED_BY_USER
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(Left) as left:
        Preemption(records)._on_signal(lifetime.signal.SIGTERM, None)  # torchrun stopping the rest
    assert left.value.args == (PEER_FAILED,) and capsys.readouterr().err == ""
    assert records.read()[0].why == STOPPED
    for machines in (1, 2):  # the exit statuses say it (130): not "a rank of another machine ended early"
        assert ended_early(records.read(), range(2), machines) is None
    assert capsys.readouterr().err == ""


@pytest.mark.slow
def test_a_full_disk_where_a_rank_writes_is_one_message_and_the_run_resumes(tmp_path, tiny_gpt2, stories):
    """A write the run does not guard itself (a tracker's, a row's) filling the disk: the user's, one message with the
    free space where the run writes (no file is named by a write() of an open file), exit 2; the run goes on with
    --resume auto from the newest checkpoint."""
    recipe = tiny_recipe(tmp_path / "r.yaml", tiny_gpt2, stories, checkpoint={"every_steps": 2, "keep_last": None})
    run = tmp_path / "run"
    proc = run_cli("recipe", "run", recipe, "--output-dir", run, env={"ACCEL_FSDP_FAULT": "enospc:3@1"})
    assert proc.returncode == 2, proc.stderr[-3000:]
    message = ("error: No space left on device (rank 1, in the logging, evaluation and checkpoint after optimizer "
               f"step 3; free space: {run} ")
    assert proc.stderr.count(message) == 1, proc.stderr[-3000:]
    assert ("    fix: free space there, or choose a path on another filesystem; then run the same command with "
            "--resume auto (it goes on from the newest checkpoint)") in proc.stderr
    quiet_end(proc.stdout + proc.stderr)
    proc = run_cli("recipe", "run", recipe, "--output-dir", run, "--resume", "auto", check=0)
    assert f"resume: continuing from {run / 'checkpoints' / 'step-000002'} at step 2" in proc.stdout + proc.stderr
    assert [r["step"] for r in read_metrics(run) if r["kind"] == "train"] == list(range(1, 9))
