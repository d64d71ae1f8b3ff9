"""Where every file of a run lives: the one home of each file name and path of a run folder and of a checkpoint.

    <run>/run.json             identity: run id, recipe name and fingerprint, checkpoint folder, version, start time
    <run>/recipe.yaml          the resolved recipe (every default filled in)
    <run>/fsdp_settings.json   effective FSDP settings, each with its source
    <run>/sharding.json        parameters each rank holds after sharding
    <run>/metrics.jsonl        one row per logged step (see train/metrics.py)
    <run>/checkpoints/         step-NNNNNN checkpoints (see checkpoint/store.py); `checkpoint.dir` may move it
    <run>/final/               the consolidated Hugging Face export of the last step
    <run>/preempted.json       written when a run stopped on a preemption signal (step, checkpoint)
    <run>/logs/, trace/        tracker files (tensorboard); test traces
    <run>/report.json, loss_curve.png   written by `accel-fsdp report`
    <run>/.accel-fsdp.lock     held (flock) by the live run; the kernel releases it when the holder dies

    <checkpoints>/.accel-fsdp-run           the run that owns this checkpoint folder
    <checkpoints>/step-NNNNNN/manifest.json, trainer_state.json, recipe.yaml, fsdp_settings.json,
                  pytorch_model_fsdp_0/ (or pytorch_model_fsdp.bin), scaler.pt, rng_state_<rank>.pt, hf/

Writers build a layout from the recipe (`RunLayout.of`); readers of an existing run build it from what the run
recorded (`RunLayout.at`), so nobody guesses `<run>/checkpoints`. This module names paths; it never writes,
deletes or locks anything (run/folder.py does), and reads nothing but run.json.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# The run folder.
RUN_FILE = "run.json"
RECIPE_FILE = "recipe.yaml"
SETTINGS_FILE = "fsdp_settings.json"
SHARDING_FILE = "sharding.json"
METRICS_FILE = "metrics.jsonl"
CHECKPOINTS_DIR = "checkpoints"
"""The checkpoint folder inside the run folder unless `checkpoint.dir` says otherwise."""
FINAL_DIR = "final"
LOGS_DIR = "logs"
TRACE_DIR = "trace"
PREEMPTED_FILE = "preempted.json"
REPORT_FILE = "report.json"
LOSS_CURVE_FILE = "loss_curve.png"
LOCK_FILE = ".accel-fsdp.lock"

# The checkpoint folder, and each checkpoint in it (which also carries RECIPE_FILE and SETTINGS_FILE).
OWNER_FILE = ".accel-fsdp-run"
MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.json"
MODEL_DIR = "pytorch_model_fsdp_0"
MODEL_FILE = "pytorch_model_fsdp.bin"
HF_DIR = "hf"
SCALER_FILE = "scaler.pt"


def rng_file(rank: int) -> str:
    return f"rng_state_{rank}.pt"


# Checkpoint folders: `step-000200`, written as `.tmp-step-000200` until complete, renamed `.trash-step-000200`
# while being deleted (rotation). All three belong to the run that owns the checkpoint folder.
STEP_PREFIX, TMP_PREFIX, TRASH_PREFIX = "step-", ".tmp-", ".trash-"
CHECKPOINT_PREFIXES = (STEP_PREFIX, TMP_PREFIX + STEP_PREFIX, TRASH_PREFIX + STEP_PREFIX)


def checkpoint_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:06d}"


def checkpoints_of(run_dir: Path, recorded: str) -> Path:
    """The checkpoint folder run.json records, for the run folder where it is now."""
    path = Path(recorded).expanduser()
    return path if path.is_absolute() else Path(run_dir) / path


@dataclass(frozen=True)
class RunLayout:
    """Every path of a run, in one place: the checkpoint folder included (`checkpoint.dir` may put it anywhere)."""

    root: Path
    checkpoints: Path

    @classmethod
    def of(cls, recipe, run_dir: Path | str | None = None) -> RunLayout:
        """The layout a run of `recipe` writes (in `run_dir`, else the recipe's output_dir, else runs/<name>)."""
        root = Path(run_dir or recipe.output_dir or f"runs/{recipe.name}").expanduser().absolute()
        d = Path(recipe.checkpoint.dir).expanduser()
        return cls(root, d if d.is_absolute() else root / d)

    @classmethod
    def at(cls, run_dir: Path | str) -> RunLayout:
        """The layout of an existing run folder, from its run.json (the checkpoint folder it recorded). A folder
        without run.json, or whose run.json is unreadable or records no checkpoint folder, keeps its checkpoints in
        the default place (runs made before run.json did). The root is `run_dir` as given (messages quote the
        user's own spelling of it)."""
        from accel_fsdp.errors import UserError
        from accel_fsdp.run.folder import RunIdentity

        root = Path(run_dir).expanduser()
        recorded = identity = None
        if (root / RUN_FILE).is_file():
            try:
                identity = RunIdentity.read(root / RUN_FILE)
                recorded = identity.checkpoint_dir
            except UserError:
                recorded = None
        if recorded and _copied_from(root, Path(recorded), identity):
            recorded = CHECKPOINTS_DIR  # a copy of a run folder: its own checkpoints, never the original's
        return cls(root, checkpoints_of(root, recorded or CHECKPOINTS_DIR))

    run_file = property(lambda self: self.root / RUN_FILE)
    recipe_file = property(lambda self: self.root / RECIPE_FILE)
    settings_file = property(lambda self: self.root / SETTINGS_FILE)
    sharding_file = property(lambda self: self.root / SHARDING_FILE)
    metrics_file = property(lambda self: self.root / METRICS_FILE)
    final = property(lambda self: self.root / FINAL_DIR)
    logs = property(lambda self: self.root / LOGS_DIR)
    trace = property(lambda self: self.root / TRACE_DIR)
    preempted_file = property(lambda self: self.root / PREEMPTED_FILE)
    report_file = property(lambda self: self.root / REPORT_FILE)
    loss_curve = property(lambda self: self.root / LOSS_CURVE_FILE)

    @property
    def external_checkpoints(self) -> bool:
        """The checkpoint folder lies outside the run folder (e.g. on scratch)."""
        return not self.checkpoints.is_relative_to(self.root)

    @property
    def recorded_checkpoints(self) -> str:
        """How run.json records the checkpoint folder: relative when inside the run folder."""
        return str(self.checkpoints) if self.external_checkpoints else str(self.checkpoints.relative_to(self.root))

    def to_dict(self) -> dict[str, str]:
        return {"run_dir": str(self.root), "checkpoint_dir": str(self.checkpoints)}


def _copied_from(root: Path, recorded: Path, identity) -> bool:
    """`root` is a copy (cp -r) of the run folder that owns `recorded`: run.json records another run folder's own
    checkpoint folder (an absolute path, as older versions wrote it), and that folder's run.json is this run's."""
    from accel_fsdp.errors import UserError
    from accel_fsdp.run.folder import RunIdentity

    if not recorded.is_absolute() or recorded.name != CHECKPOINTS_DIR:
        return False
    original = recorded.parent
    try:
        if original.resolve() == root.resolve() or not (original / RUN_FILE).is_file():
            return False
        return RunIdentity.read(original / RUN_FILE).run_id == identity.run_id
    except (OSError, UserError):
        return False
