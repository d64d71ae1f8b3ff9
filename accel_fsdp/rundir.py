"""The run folder: what it holds, and the guard that keeps a new run from overwriting an old one.

    <run>/run.json             identity: recipe name and fingerprint, accel-fsdp version, start time
    <run>/recipe.yaml          the resolved recipe (every default filled in)
    <run>/fsdp_settings.json   effective FSDP settings, each with its source
    <run>/sharding.json        parameters each rank holds after sharding
    <run>/metrics.jsonl        one row per logged step (see metrics.py)
    <run>/checkpoints/         step-NNNNNN checkpoints (see checkpoint.py)
    <run>/final/               the consolidated Hugging Face export of the last step
    <run>/logs/                tracker files (tensorboard)

A folder that already holds a run is refused unless the user says --resume (continue it) or --overwrite
(replace it); a non-empty folder that is not a run is never written into.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from accel_fsdp.errors import Problem, UserError

RUN_FILE = "run.json"
OWNED = ("run.json", "recipe.yaml", "fsdp_settings.json", "sharding.json", "metrics.jsonl", "checkpoints", "final",
         "logs", "trace", "loss_curve.png", "report.json")


def default_run_dir(recipe) -> Path:
    return Path(recipe.output_dir or f"runs/{recipe.name}")


def check_run_dir(run_dir: Path, recipe, *, resume: bool, overwrite: bool, resume_from: bool = False) -> str:
    """Decide what to do with the folder: 'new', 'resume' or 'overwrite'. Raises a UserError to refuse.

    `resume`: continue the run in this folder. `resume_from`: start from a given checkpoint, writing into this
    folder (a new one, or the run the checkpoint belongs to)."""
    if not run_dir.exists():
        if resume:
            raise UserError(Problem(str(run_dir), "--resume was given, but the run folder does not exist",
                                    "drop --resume to start a new run, or give the --output-dir of the run to resume"))
        return "new"
    if not run_dir.is_dir():
        raise UserError(Problem(str(run_dir), "exists and is not a folder", "choose another --output-dir"))
    info_file = run_dir / RUN_FILE
    if not info_file.exists():
        if any(run_dir.iterdir()):
            raise UserError(Problem(str(run_dir), "is not empty and does not hold an accel-fsdp run",
                                    "choose another --output-dir (nothing was changed)"))
        if resume:
            raise UserError(Problem(str(run_dir), "--resume was given, but the folder holds no run",
                                    "drop --resume to start a new run here"))
        return "new"
    info = json.loads(info_file.read_text())
    if overwrite:
        return "overwrite"
    if resume or resume_from:
        return "resume"
    same = info.get("recipe_fingerprint") == recipe.fingerprint()
    what = "a run of this same recipe" if same else \
        f"a different run (recipe {info.get('recipe_name')!r}, fingerprint {info.get('recipe_fingerprint')})"
    raise UserError(Problem(str(run_dir), f"already holds {what}",
                            "add --resume to continue it, --overwrite to replace it, or choose another --output-dir "
                            "(nothing was changed)"))


def prepare_run_dir(run_dir: Path, recipe, settings, decision: str, checkpoint_root: Path) -> None:
    """Main process only: clear an overwritten run (only files accel-fsdp wrote) and record the new identity."""
    if decision == "overwrite":
        for name in OWNED:
            target = run_dir / name
            if target.is_dir():
                shutil.rmtree(target)
            elif target.exists():
                target.unlink()
        if checkpoint_root.exists() and not checkpoint_root.is_relative_to(run_dir):
            for step_dir in checkpoint_root.glob("step-*"):
                shutil.rmtree(step_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if decision != "resume":
        info = {"recipe_name": recipe.name, "recipe_fingerprint": recipe.fingerprint(),
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        from accel_fsdp import __version__

        info["accel_fsdp_version"] = __version__
        (run_dir / RUN_FILE).write_text(json.dumps(info, indent=1) + "\n")
    (run_dir / "recipe.yaml").write_text(recipe.to_yaml())
    (run_dir / "fsdp_settings.json").write_text(json.dumps(settings.to_dict(), indent=1, default=str) + "\n")
