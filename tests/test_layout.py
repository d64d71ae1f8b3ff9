"""One home for every path of a run: the SLURM script, the checkpoint code and the CLI agree on where a run's
checkpoints are, with `checkpoint.dir` left at its default and moved outside the run folder (where a copied path
once let a requeued job delete its own checkpoints). Also the typed checkpoint records, and the argv `recipe run`
hands its ranks. In-process or one short CLI subprocess each; nothing here launches ranks."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import fabricate_checkpoint

from accel_fsdp.cli import main
from accel_fsdp.config.shipped import shipped_recipes


def slurm_script(tmp_path: Path, run: Path, overrides: list[str]) -> Path:
    script = tmp_path / "job.sbatch"
    args = ["slurm", "quickstart", "--nodes", "1", "--gpus-per-node", "2", "--accelerate-config", "fsdp_cpu",
            "--output-dir", str(run), "-o", str(script)]
    for item in overrides:
        args += ["--set", item]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    return script


def script_variable(text: str, name: str) -> str:
    m = re.search(rf"^export {name}=(.*)$", text, re.M)
    assert m, f"the script sets no {name}"
    return shlex.split(m.group(1))[0]


def job_start_log(script: Path, tmp_path: Path) -> str:
    """What the job prints before it launches: the script up to the end of its `recipe validate` block, run by bash
    with a stand-in for scontrol."""
    text = script.read_text()
    head = text[:text.index('echo "-----"\n', text.index("recipe validate")) + len('echo "-----"\n')]
    (tmp_path / "head.sh").write_text(head)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/bash\necho localhost\n")
    (bin_dir / "scontrol").chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_NODELIST="localhost",
               SLURM_JOB_ID="4242", SLURM_JOB_NUM_NODES="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run(["bash", str(tmp_path / "head.sh")], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.parametrize("where", ["default", "outside the run folder"])
def test_slurm_script_checkpoint_code_and_cli_agree_on_where_checkpoints_are(tmp_path, where):
    from accel_fsdp.checkpoint.index import checkpoint_to_resume, list_checkpoints
    from accel_fsdp.config.recipe import load_recipe
    from accel_fsdp.layout import RunLayout
    from accel_fsdp.run.folder import Decision, apply_decision, decide

    scratch = tmp_path / "scratch" / "ckpts"
    overrides = [f"checkpoint.dir={scratch}"] if where != "default" else []
    script = slurm_script(tmp_path, tmp_path / "run", overrides)
    text = script.read_text()
    run_dir = Path(script_variable(text, "RUN_DIR"))
    recipe = load_recipe(script_variable(text, "RECIPE"), overrides)

    layout = RunLayout.of(recipe, run_dir)
    expected = scratch if where != "default" else run_dir / "checkpoints"
    assert layout.checkpoints == expected and layout.external_checkpoints == (where != "default")
    # The job says where its checkpoints go, at job start.
    assert f"  checkpoints: {expected}\n" in job_start_log(script, tmp_path)

    # The run folder as the run leaves it (prepare: run.json, owner file), then a checkpoint where the run saves.
    class Settings:
        def to_dict(self):
            return {}

    identity = apply_decision(layout, recipe, Settings(), Decision.NEW)
    step_dir = fabricate_checkpoint(layout.checkpoints, 3, identity.run_id)

    assert RunLayout.at(run_dir).checkpoints == expected  # what readers build from run.json
    assert [c.path for c in list_checkpoints(RunLayout.at(run_dir).checkpoints)] == [step_dir]
    # --resume auto (what the requeued job runs) resumes from it ...
    assert decide(RunLayout.of(recipe, run_dir), recipe, resume="auto") == Decision.RESUME
    assert checkpoint_to_resume(layout.checkpoints, None).checkpoint.path == step_dir
    # ... and `checkpoint inspect RUN_DIR` finds it at the same place.
    result = CliRunner().invoke(main, ["checkpoint", "inspect", str(run_dir), "--json"])
    assert result.exit_code == 0, result.output
    [described] = json.loads(result.output)  # a run folder: a list, of one here
    assert Path(described["path"]).resolve() == step_dir.resolve() and described["complete"]


def test_run_layout_at_reads_the_recorded_checkpoint_folder(tmp_path):
    from accel_fsdp.layout import RunLayout

    run = tmp_path / "run"
    run.mkdir()
    assert RunLayout.at(run).checkpoints == run / "checkpoints"  # no run.json: the default place
    (run / "run.json").write_text(json.dumps({"run_id": "a", "checkpoint_dir": "ckpts"}))
    assert RunLayout.at(run).checkpoints == run / "ckpts"  # relative: inside the run folder, wherever it moved
    (run / "run.json").write_text(json.dumps({"run_id": "a", "checkpoint_dir": str(tmp_path / "scratch")}))
    layout = RunLayout.at(run)
    assert layout.checkpoints == tmp_path / "scratch" and layout.external_checkpoints
    assert layout.metrics_file == run / "metrics.jsonl" and layout.final == run / "final"


def test_owned_names_come_from_the_layout():
    from accel_fsdp import layout
    from accel_fsdp.layout import RUN_FOLDER_ENTRIES as OWNED

    assert set(OWNED) == {layout.RUN_FILE, layout.RECIPE_FILE, layout.SETTINGS_FILE, layout.SHARDING_FILE,
                          layout.METRICS_FILE, layout.CHECKPOINTS_DIR, layout.FINAL_DIR, layout.LOGS_DIR,
                          layout.TRACE_DIR, layout.LOSS_CURVE_FILE, layout.REPORT_FILE, layout.PREEMPTED_FILE,
                          layout.RUN_PARAMETERS_FILE, layout.REFERENCE_DIR, layout.SCRATCH_BASE_DIR, layout.PROFILE_DIR}


# ------------------------------------------------------------------------------------------------ records


def test_manifest_round_trips_the_json_keys_and_names_damage():
    from accel_fsdp.checkpoint.records import FORMAT, DamagedRecord, Manifest

    data = {"format": FORMAT, "step": 7, "epoch": 0, "world_size": 2, "state_dict_type": "SHARDED_STATE_DICT",
            "fsdp_version": 2, "lora": False, "recipe_fingerprint": "f", "run_id": "r", "parameters": 10,
            "trainable_parameters": 10, "created": "now", "versions": {"torch": "x"}, "quantized_base": None,
            "starting_weights": "w", "data": {"d": {"key": "data.path", "identity": {"file": "/d.jsonl", "size": 3, "mtime_ns": 1}}},
            "files": {"a": 1}, "crc32": {"a": "00000000"}}
    m = Manifest.from_dict(data)
    assert m.to_dict() == data and list(m.to_dict()) == list(data) and json.loads(m.to_json()) == data
    assert m.step == 7 and m.lora is False
    assert Manifest.from_dict({"step": 1, "files": {}}).format is None  # unknown format, not ours by default
    with pytest.raises(DamagedRecord, match=r"ckpt: incomplete or corrupt checkpoint: manifest.json is damaged "
                       r"\(step 'x' is not a step number\)"):
        Manifest.from_dict({"step": "x", "files": {}}, checkpoint="ckpt")
    with pytest.raises(DamagedRecord, match="its file list names paths outside the checkpoint"):
        Manifest.from_dict({"step": 1, "files": {"../x": 1}})
    with pytest.raises(DamagedRecord, match="its data identity is not a mapping of source to identity"):
        Manifest.from_dict({"step": 1, "files": {}, "data": ["d.jsonl"]})
    assert Manifest.from_dict({"step": "x", "run_id": "r"}, checked=False).run_id == "r"


def test_trainer_state_keeps_its_json_and_unknown_keys():
    from accel_fsdp.checkpoint.records import DamagedRecord, TrainerState

    data = {"step": 4, "epoch": 1, "batch_in_epoch": 0, "rows_consumed": 128, "tokens_seen": 999, "total_steps": 8,
            "parameters": 10, "trainable_parameters": 5, "data": {"step": 4, "units": [100, 28], "drawn": [9e3, 3e3]},
            "scheduler": {"last_epoch": 4}}
    s = TrainerState.from_dict(data)
    assert s.to_dict() == data and list(s.to_dict()) == list(data)
    assert s.step == 4 and s.tokens_seen == 999
    old = TrainerState.from_dict({"step": 2, "future_key": 1})
    assert old.tokens_seen is None and old.extra["future_key"] == 1 and old.to_dict()["future_key"] == 1
    with pytest.raises(DamagedRecord, match=r"trainer_state.json is damaged \(step None is not a step number\)"):
        TrainerState.from_dict({"epoch": 1}, checkpoint="ckpt")


# -------------------------------------------------------------------------------------------- child argv


def test_recipe_run_hands_its_ranks_what_the_user_gave_less_what_the_launcher_consumes(tmp_path, monkeypatch):
    launched = []
    monkeypatch.setattr("accel_fsdp.launch.launcher.launch", lambda config, argv, **k: launched.append(argv) or 0)
    recipe = shipped_recipes()["quickstart"]
    run = tmp_path / "run"
    result = CliRunner().invoke(main, ["recipe", "run", "quickstart", "--accelerate-config", "fsdp_cpu",
                                       "--set", "training.lr=1e-3", "--set", "training.max_steps=20",
                                       "--output-dir", str(run), "--verbose", "--rendezvous-timeout", "30",
                                       "--num-processes", "2"])
    assert result.exit_code == 0, result.output
    assert launched == [["recipe", "run", str(Path(recipe).absolute()), "--set", "training.lr=1e-3",
                         "--set", "training.max_steps=20", "--output-dir", str(run.absolute()), "--verbose"]]
    # The run folder is always passed (the ranks must not derive it again), absolute.
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["recipe", "run", "quickstart", "--accelerate-config", "fsdp_cpu",
                                       "--output-dir", "rel", "--resume", "auto", "--benchmark"])
    assert result.exit_code == 0, result.output
    assert launched[-1] == ["recipe", "run", str(Path(recipe).absolute()), "--output-dir", str(tmp_path / "rel"),
                            "--resume", "auto", "--benchmark"]


def test_child_argv_writes_back_every_kind_of_parameter():
    import click

    from accel_fsdp.cli.options import child_argv

    seen = []

    @click.group()
    def top():
        pass

    @top.command("cmd")
    @click.argument("name")
    @click.option("-o", "--out", type=click.Path(path_type=Path))
    @click.option("--tag", multiple=True)
    @click.option("--mode", type=click.Choice(["a", "b"]), is_flag=False, flag_value="a", default=None)
    @click.option("--offload/--no-offload", default=None)
    @click.option("--fast", is_flag=True)
    @click.option("--port", default=5, type=int)
    @click.option("--parent-only")
    def cmd(**kwargs):
        seen.append(child_argv(click.get_current_context(), parent_only={"parent_only"}, given={"name": "/abs/n"}))

    result = CliRunner().invoke(top, ["cmd", "n", "-o", "x", "--tag", "1", "--tag", "2", "--mode", "--no-offload",
                                      "--fast", "--parent-only", "p"])
    assert result.exit_code == 0, result.output
    assert seen[-1] == ["cmd", "/abs/n", "--out", "x", "--tag", "1", "--tag", "2", "--mode", "a", "--no-offload",
                        "--fast"]
    CliRunner().invoke(top, ["cmd", "n", "--port", "7", "--offload"])
    assert seen[-1] == ["cmd", "/abs/n", "--offload", "--port", "7"]
