"""A resumed run goes on as the uninterrupted one would: from the newest intact checkpoint when a newer one is damaged
(a file changed in place, or cut short), keeping the damaged one aside, and with a metrics.jsonl whose rows average
the same steps. Also what an export of a run folder and rotation do with damaged step folders (no ranks needed)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import fabricate_checkpoint, load_weights, read_metrics, run_cli, tiny_recipe

from accel_fsdp.checkpoint.index import inspect_checkpoint
from accel_fsdp.tools.noise import reordered

STEPS = 8
GLOBAL_BATCH, MICRO_BATCH = 8, 2  # 2 ranks x 2 accumulation steps


@pytest.fixture(scope="module")
def recipe(tmp_path_factory, tiny_gpt2, stories) -> Path:
    """8 steps, checkpoints after steps 3, 6 and 8, a train row every 4 steps (a window a checkpoint cuts)."""
    folder = tmp_path_factory.mktemp("resume")
    return tiny_recipe(folder / "recipe.yaml", tiny_gpt2, stories,
                       training={"max_steps": STEPS, "mixed_precision": "fp32", "global_batch_size": GLOBAL_BATCH,
                                 "micro_batch_size": MICRO_BATCH},
                       data={"eval_fraction": 0},
                       checkpoint={"every_steps": 3, "keep_last": None},
                       logging={"every_steps": 4})


@pytest.fixture(scope="module")
def uninterrupted(recipe) -> Path:
    run = recipe.parent / "uninterrupted"
    run_cli("recipe", "run", recipe, "--output-dir", run, check=0)
    return run


def train_rows(run: Path) -> list[dict]:
    return [r for r in read_metrics(run) if r["kind"] == "train"]


def assert_rows_average_the_same_steps(run: Path, reference: Path) -> None:
    """The same train rows, step for step, with the same loss and gradient norm. The two runs computed the same
    numbers in the same order on CPU, but the resumed one added a window's sums up in two parts (float32 on the
    ranks before the checkpoint, float64 after): each is a sum of at most ranks x accumulation x steps terms of one
    sign, so within reordered() of it. A row that averages other steps is off by the steps' spread (percent)."""
    rows, expected = train_rows(run), train_rows(reference)
    assert [r["step"] for r in rows] == [r["step"] for r in expected] == [4, 8]
    tolerance = reordered(GLOBAL_BATCH // MICRO_BATCH * STEPS)
    for row, want in zip(rows, expected):
        for key in ("loss", "grad_norm"):
            assert abs(row[key] - want[key]) <= tolerance * abs(want[key]), (row["step"], key, row[key], want[key])


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_first_row_after_a_resume_averages_the_steps_of_the_uninterrupted_runs_row(tmp_path, recipe,
                                                                                        uninterrupted):
    run = tmp_path / "run"
    killed = run_cli("recipe", "run", recipe, "--output-dir", run, env={"ACCEL_FSDP_FAULT": "kill:5"})
    assert killed.returncode != 0 and [r["step"] for r in train_rows(run)] == [4]  # steps 1-4, then killed
    run_cli("recipe", "run", recipe, "--output-dir", run, "--resume", check=0)  # from step 3: steps 1-3 were saved
    assert_rows_average_the_same_steps(run, uninterrupted)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_resuming_a_finished_run_logs_its_last_evaluation_once(tmp_path, tiny_gpt2, stories):
    """`--resume` of a run that ended (the obvious retry of a finished job) trains nothing and exports again: the
    evaluation of its last step, which its metrics kept, is not logged a second time (it was, as a duplicate row)."""
    recipe = tiny_recipe(tmp_path / "recipe.yaml", tiny_gpt2, stories, training={"max_steps": 2})
    run = tmp_path / "run"
    run_cli("recipe", "run", recipe, "--output-dir", run, check=0)
    evals = [r for r in read_metrics(run) if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [2]
    run_cli("recipe", "run", recipe, "--output-dir", run, "--resume", check=0)
    assert [r for r in read_metrics(run) if r["kind"] == "eval"] == evals


def damage(checkpoint: Path, how: str) -> str:
    """Damage one model shard of a checkpoint; return the file's name as messages give it."""
    shard = sorted((checkpoint / "pytorch_model_fsdp_0").glob("*.distcp"))[-1]
    data = shard.read_bytes()
    if how == "changed":  # same size, one byte flipped: only its CRC-32 tells
        data = data[: len(data) // 2] + bytes([data[len(data) // 2] ^ 0xFF]) + data[len(data) // 2 + 1:]
    else:  # cut short: its size tells
        data = data[: len(data) // 2]
    shard.write_bytes(data)
    return str(shard.relative_to(checkpoint))


@pytest.mark.slow
@pytest.mark.multiprocess
def test_resume_auto_goes_back_past_damaged_newest_checkpoints_and_says_why(tmp_path, recipe, uninterrupted):
    """Both kinds of damage in one run: the newest checkpoint changed in place (only its CRC-32 tells), the one
    before it cut short (its size tells); the run goes back past both to step 3, naming each and why, once."""
    run = tmp_path / "run"
    shutil.copytree(uninterrupted, run)
    changed = damage(run / "checkpoints" / "step-000008", "changed")
    truncated = damage(run / "checkpoints" / "step-000006", "truncated")
    damaged = {8: (run / "checkpoints" / "step-000008" / changed).read_bytes(),
               6: (run / "checkpoints" / "step-000006" / truncated).read_bytes()}
    proc = run_cli("recipe", "run", recipe, "--output-dir", run, "--resume", "auto", check=0)
    said = proc.stdout + proc.stderr
    # The damaged ones are kept aside as they were, not replaced by the run's own steps 6 and 8 (nor counted by
    # rotation).
    kept = {p.name: p.parent for p in (run / "checkpoints").glob("damaged-*/step-*")}
    assert set(kept) == {"step-000008", "step-000006"}, kept
    for name, step, reason in ((changed, 8, "changed since it was saved (CRC-32 differs"),
                               (truncated, 6, "bytes, the manifest says")):
        folder = f"step-{step:06d}"
        assert f"{folder} is newer but not usable ({name}" in said, said[-3000:]
        # Said once, by the ranks (the launcher's checks found it too, before launching, and left it to them).
        assert said.count(f"{folder} is newer but not usable") == 1, said[-3000:]
        note = next(line for line in said.splitlines() if f"{folder} is newer but not usable" in line)
        assert reason in note and "continuing from step-000003" in note, note
        assert (kept[folder] / folder / name).read_bytes() == damaged[step]
        assert inspect_checkpoint(run / "checkpoints" / folder, verify=True).complete
    assert f"resume: step-000008, step-000006 kept in {kept['step-000008']} (accel-fsdp never deletes it" in said
    assert f"resume: continuing from {run / 'checkpoints' / 'step-000003'} at step 3" in said
    weights, expected = load_weights(run / "final"), load_weights(uninterrupted / "final")
    assert weights.keys() == expected.keys()
    for key, tensor in weights.items():  # steps 4 to 8 again, computed as the first time (CPU kernels)
        assert tensor.equal(expected[key]), key
    assert_rows_average_the_same_steps(run, uninterrupted)


# ---------------------------------------------------------------------------------------- no ranks needed


@pytest.mark.parametrize("how", ["changed", "truncated"])
def test_the_checkpoint_to_resume_is_the_newest_intact_one(tmp_path, how):
    from accel_fsdp.checkpoint.index import checkpoint_to_resume

    for step in (3, 6, 9):
        fabricate_checkpoint(tmp_path, step)
    weights = tmp_path / "step-000009" / "weights"
    data = weights.read_bytes()
    weights.write_bytes(data[:-1] + b"\xff" if how == "changed" else data[:-1])
    point = checkpoint_to_resume(tmp_path, None)
    assert point.checkpoint.name == "step-000006"
    (skipped,) = point.notes()
    assert skipped.startswith("step-000009 is newer but not usable (weights ")
    assert skipped.endswith(": continuing from step-000006")
    assert checkpoint_to_resume(tmp_path, None, verify_up_to=0).checkpoint.name == (
        "step-000009" if how == "changed" else "step-000006")  # unread, a changed file is not seen (the ranks read it)


@pytest.mark.parametrize("how", ["changed", "truncated"])
def test_an_export_of_a_run_folder_takes_its_newest_intact_checkpoint_as_a_resume_does(tmp_path, how):
    """`checkpoint consolidate RUN` goes back past a newest checkpoint with a file changed since as past one cut short
    (it stopped at the first, while passing over the second), naming it."""
    from accel_fsdp.checkpoint.index import resolve_checkpoint

    for step in (3, 6):
        fabricate_checkpoint(tmp_path, step)
    weights = tmp_path / "step-000006" / "weights"
    data = weights.read_bytes()
    weights.write_bytes(data[:-1] + b"\xff" if how == "changed" else data[:-1])
    point = resolve_checkpoint(tmp_path, verify=True)
    assert point.checkpoint.name == "step-000003"
    assert [(c.name, c.reason.split(" ")[0]) for c in point.passed_over] == [("step-000006", "weights")]


def test_rotation_removes_damaged_step_folders_older_than_the_checkpoints_it_keeps(tmp_path):
    from accel_fsdp.checkpoint.store import rotate

    for step in (2, 4, 6, 8, 10):
        fabricate_checkpoint(tmp_path, step)
    (tmp_path / "step-000002" / "manifest.json").unlink()  # a save that lost its manifest
    (tmp_path / "step-000006" / "weights").write_bytes(b"short")  # cut short
    (tmp_path / "step-000012").mkdir()  # newer than every checkpoint kept: left alone
    removed = rotate(tmp_path, keep_last=2)
    assert sorted(p.name for p in removed) == ["step-000002", "step-000004", "step-000006"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000008", "step-000010", "step-000012"]


def test_rotation_removes_a_damaged_step_folder_between_the_checkpoints_it_keeps(tmp_path):
    """Never resumable (a newer complete checkpoint is read first, and one past it only if that one is damaged
    too), so gone with the next save, not kept until the checkpoints around it have rotated away."""
    from accel_fsdp.checkpoint.store import rotate

    for step in (2, 4, 6):
        fabricate_checkpoint(tmp_path, step)
    (tmp_path / "step-000004" / "weights").write_bytes(b"short")  # cut short
    assert [p.name for p in rotate(tmp_path, keep_last=3, newest=6)] == ["step-000004"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000002", "step-000006"]


def test_rotation_never_removes_the_checkpoint_just_saved_for_a_newer_one(tmp_path):
    """A newer checkpoint whose bytes changed has the manifest's sizes: complete, as far as rotation reads. Counted
    among the newest, it would rotate away the intact one just written (and with it a run's only good state)."""
    from accel_fsdp.checkpoint.store import rotate

    for step in (6, 7, 8):
        fabricate_checkpoint(tmp_path, step)
    weights = tmp_path / "step-000008" / "weights"
    weights.write_bytes(weights.read_bytes()[:-1] + b"\xff")  # changed in place: its CRC-32 tells, its size does not
    assert [p.name for p in rotate(tmp_path, keep_last=1, newest=7)] == ["step-000006"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000007", "step-000008"]


def test_a_trainer_state_keeps_its_logging_window():
    from accel_fsdp.checkpoint.records import LogWindow, TrainerState

    window = {"steps": 3, "loss": 9.5, "grad_norm": 4.25, "sums": {"pairs": 24.0, "reward_chosen": -1.5}}
    state = TrainerState.from_dict({"step": 3, "log_window": window, "scheduler": {}})
    assert state.log_window == LogWindow(steps=3, loss=9.5, grad_norm=4.25,
                                         sums={"pairs": 24.0, "reward_chosen": -1.5})
    assert json.loads(json.dumps(state.to_dict()))["log_window"] == window
    for damaged in ({"steps": "3"}, {"steps": 3, "loss": "x", "grad_norm": 1.0, "sums": {}}, [3]):
        assert TrainerState.from_dict({"step": 3, "log_window": damaged}).log_window is None
    assert "log_window" not in TrainerState(step=3).to_dict()
