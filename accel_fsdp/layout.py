"""Where every file of a run lives, the run's identity record (run.json), and the project's cache folder: the one
home of each file name and path of a run folder and of a checkpoint. The ground floor: it imports nothing of the
package but errors.py and files.py (how a file is written).

    <run>/run.json             identity: run id, recipe name and fingerprint, checkpoint folder, version, start time
    <run>/recipe.yaml          the resolved recipe (every default filled in)
    <run>/fsdp_settings.json   effective FSDP settings, each with its source
    <run>/sharding.json        parameters each rank holds after sharding
    <run>/metrics.jsonl        one row per logged step (see train/metrics.py)
    <run>/checkpoints/         step-NNNNNN checkpoints (see checkpoint/store.py); `checkpoint.dir` may move it
    <run>/final/               the consolidated Hugging Face export of the last step
    <run>/preempted.json       written when a run stopped on a preemption signal (step, checkpoint)
    <run>/logs/, trace/        tracker files (tensorboard); test traces
    <run>/profile/             `recipe run --profile`: each rank's profiler trace and operator tables
    <run>/report.json, loss_curve.png   written by `accel-fsdp report`
    <run>/run_parameters.json  parameter counts of a `verify` probe run
    <run>/.accel-fsdp.lock     held (flock) by the live run; the kernel releases it when the holder dies

    <checkpoints>/.accel-fsdp-run           the run that owns this checkpoint folder
    <checkpoints>/step-NNNNNN/manifest.json, trainer_state.json, recipe.yaml, fsdp_settings.json,
                  pytorch_model_fsdp_0/ (or pytorch_model_fsdp.bin), scaler.pt, rng_state_<rank>.pt, hf/

Writers build a layout from the recipe (`RunLayout.of`); readers of an existing run build it from what the run
recorded (`RunLayout.at`), so nobody guesses `<run>/checkpoints`. This module names paths and reads and writes
run.json; it never deletes or locks anything (run/folder.py decides what a start may do with a folder).
"""

from __future__ import annotations

import json
import os
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from accel_fsdp import __version__
from accel_fsdp.errors import Problem, UserError, read_json_object
from accel_fsdp.files import write_atomic

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
PROFILE_DIR = "profile"
PREEMPTED_FILE = "preempted.json"
REPORT_FILE = "report.json"
LOSS_CURVE_FILE = "loss_curve.png"
LOCK_FILE = ".accel-fsdp.lock"
RUN_PARAMETERS_FILE = "run_parameters.json"
REFERENCE_DIR = "reference"
"""A DPO run's reference log-probabilities when the cache cannot hold them (a read-only prepared cache)."""
SCRATCH_BASE_DIR = "base"
"""A 4-bit base built from scratch (model.architecture with model.quantize), written as model files: what the adapters
name as their base, and `checkpoint consolidate --merge` merges into."""
RUN_FOLDER_ENTRIES = (RUN_FILE, RECIPE_FILE, SETTINGS_FILE, SHARDING_FILE, METRICS_FILE, CHECKPOINTS_DIR, FINAL_DIR,
                      LOGS_DIR, TRACE_DIR, LOSS_CURVE_FILE, REPORT_FILE, PREEMPTED_FILE, RUN_PARAMETERS_FILE,
                      REFERENCE_DIR, SCRATCH_BASE_DIR, PROFILE_DIR)
"""Everything accel-fsdp writes into a run folder: an overwrite removes these and nothing else."""

EXPORT_RECORD = "accel_fsdp_export.json"
"""In an export (a run's final/, a `checkpoint consolidate` output): the checkpoint it was made from, its step, dtype,
whether it is an adapter, and its files."""

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
READING_PREFIX = ".reading-"
"""`.reading-step-N` beside step-N: its readers' shared lock, which rotation passes over (files.py FileLock)."""
CHECKPOINT_PREFIXES = (STEP_PREFIX, TMP_PREFIX + STEP_PREFIX, TRASH_PREFIX + STEP_PREFIX)


def reading_lock(checkpoint: Path) -> Path:
    """The lock file the readers of a checkpoint folder hold (shared) and its rotation takes (exclusive)."""
    return checkpoint.with_name(READING_PREFIX + checkpoint.name)


def checkpoint_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:06d}"


def checkpoint_step(name: str) -> int | None:
    """The step of a checkpoint folder's name (step-000200 -> 200), None for any other name."""
    number = name.removeprefix(STEP_PREFIX)
    well_formed = name.startswith(STEP_PREFIX) and len(number) >= 6 and number.isascii() and number.isdigit()
    return int(number) if well_formed else None


def dangling_link_problem(path: Path) -> Problem | None:
    """A path that is a symbolic link to nothing (a loop, or a target gone): `exists()` is False for it, and "does not
    exist" would send the user looking for a file that is there."""
    if not path.is_symlink() or path.exists():
        return None
    try:
        target = os.readlink(path)
    except OSError:
        target = "?"
    return Problem(str(path), f"is a symbolic link that leads nowhere (to {target!r}: a loop of links, or its target "
                   "is gone)", "point the link at a folder that exists, or give that folder itself")


def existing_folder(path: str | Path, *, what: str = "checkpoint") -> Path:
    """`path` (a checkpoint or run folder the user named) as a folder that exists, else one message."""
    p = Path(path).expanduser()
    if (dangling := dangling_link_problem(p)) is not None:
        raise UserError(dangling)
    if not p.exists():
        raise UserError(Problem(str(p), f"no such {what}", "give a step-NNNNNN folder or a run folder (`accel-fsdp "
                                "checkpoint inspect RUN` lists a run's; rotation keeps the last checkpoint.keep_last)"))
    if not p.is_dir():
        raise UserError(Problem(str(p), f"is a file, not a {what} folder", "give a step-NNNNNN folder or a run folder"))
    return p


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
        without a readable run.json keeps its checkpoints in the default place. The root is `run_dir` as given
        (messages quote the user's own spelling of it)."""
        root = Path(run_dir).expanduser()
        recorded = None
        if (root / RUN_FILE).is_file():
            try:
                recorded = RunIdentity.read(root / RUN_FILE).checkpoint_dir
            except UserError:
                recorded = None
        return cls(root, checkpoints_of(root, recorded or CHECKPOINTS_DIR))

    run_file = property(lambda self: self.root / RUN_FILE)
    recipe_file = property(lambda self: self.root / RECIPE_FILE)
    settings_file = property(lambda self: self.root / SETTINGS_FILE)
    sharding_file = property(lambda self: self.root / SHARDING_FILE)
    metrics_file = property(lambda self: self.root / METRICS_FILE)
    final = property(lambda self: self.root / FINAL_DIR)
    logs = property(lambda self: self.root / LOGS_DIR)
    trace = property(lambda self: self.root / TRACE_DIR)
    profile = property(lambda self: self.root / PROFILE_DIR)
    preempted_file = property(lambda self: self.root / PREEMPTED_FILE)
    report_file = property(lambda self: self.root / REPORT_FILE)
    loss_curve = property(lambda self: self.root / LOSS_CURVE_FILE)
    run_parameters_file = property(lambda self: self.root / RUN_PARAMETERS_FILE)
    reference = property(lambda self: self.root / REFERENCE_DIR)

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


@dataclass
class RunIdentity:
    """run.json: which run a folder holds."""
    run_id: str
    recipe_name: str | None = None
    recipe_fingerprint: str | None = None
    checkpoint_dir: str | None = None
    """Relative to the run folder when inside it (a moved or copied run folder keeps its own), else absolute."""
    created: str | None = None
    accel_fsdp_version: str | None = None
    resumed_from: str | None = None
    """The checkpoint of another run this one started from (--resume-from into a new folder)."""
    finished_at: float | None = None
    """When the last start of this run finished its work (export included), seconds since the epoch; None while it
    runs. The launcher reads it to tell a preemption signal that came after the end from one that stopped the run."""
    @classmethod
    def new(cls, recipe, layout: RunLayout, resumed_from: str | None = None, run_id: str | None = None) -> RunIdentity:

        return cls(run_id=run_id or uuid.uuid4().hex[:16], recipe_name=recipe.name,
                   recipe_fingerprint=recipe.fingerprint(), checkpoint_dir=layout.recorded_checkpoints,
                   created=time.strftime("%Y-%m-%dT%H:%M:%S%z"), accel_fsdp_version=__version__,
                   resumed_from=resumed_from)

    @classmethod
    def read(cls, path: Path) -> RunIdentity:
        """Read run.json; a damaged one is the user's to fix (we cannot tell whose run it is)."""
        what, then = "is unreadable or corrupt", ", so it is not known which run this folder holds"
        fix = "restore run.json, or choose another --output-dir (nothing was changed)"
        data = read_json_object(path, what=what, then=then, fix=fix)
        if not isinstance(data.get("run_id"), str) or not data["run_id"]:
            raise UserError(Problem(str(path), f"records no run id{then}", fix))
        return cls(**{k: data.get(k) for k in cls.__dataclass_fields__})

    def write(self, path: Path) -> None:
        write_atomic(path, json.dumps(asdict(self), indent=1) + "\n")

    def describe(self) -> str:
        return f"run {self.run_id} of recipe {self.recipe_name!r}"


def record_finished(layout: RunLayout) -> None:
    """The main process, once the run's work is done (export included): run.json says when. A run.json removed or
    damaged meanwhile is left as it is (the work is done; only a late signal's exit status depends on it)."""
    try:
        identity = RunIdentity.read(layout.run_file)
        identity.finished_at = time.time()
        identity.write(layout.run_file)
    except (UserError, OSError):
        pass


def finished_since(run_dir: Path, since: float) -> bool:
    """Whether the run in `run_dir` finished its work after `since` (seconds since the epoch)."""
    try:
        run_file = Path(run_dir) / RUN_FILE
        finished = RunIdentity.read(run_file).finished_at if run_file.is_file() else None
    except UserError:
        return False
    return isinstance(finished, (int, float)) and finished >= since


CACHE_ENV = "ACCEL_FSDP_CACHE"
"""The project's cache folder, when the user chooses one."""


def cache_dir() -> Path:
    """The project's cache: generated built-in data and tokenizers, tokenized datasets. ACCEL_FSDP_CACHE, else
    $XDG_CACHE_HOME/accel_fsdp, else ~/.cache/accel_fsdp. Absolute (a relative value is read from the folder the
    command started in, which the ranks share) and a folder, or one message naming the variable that chose it."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    if os.environ.get(CACHE_ENV):
        return folder_from_environment(CACHE_ENV, os.environ[CACHE_ENV])
    if os.path.isabs(xdg):  # the XDG spec: an empty or relative value is ignored
        return folder_from_environment("XDG_CACHE_HOME", xdg, "accel_fsdp")
    return Path("~/.cache/accel_fsdp").expanduser().absolute()


def folder_from_environment(variable: str, value: str, *below: str) -> Path:
    """The folder an environment variable names (`~` expanded, made absolute), with `below` appended; one message
    when it, or a folder above it, is a file (every write there would fail far from the variable that chose it:
    "Not a directory" about a path the user never typed). A folder that does not exist yet is created by its first
    writer."""
    path = Path(value).expanduser().absolute().joinpath(*below)
    blocking = next((p for p in (path, *path.parents) if p.exists() or p.is_symlink()), None)
    if blocking is not None and not blocking.is_dir():
        what = "a file" if blocking.exists() else "a link that leads nowhere"
        shown = f"{value!r} is" if blocking == path else f"{value!r}: {blocking} is"
        raise UserError(Problem(variable, f"{shown} {what}, not a folder",
                                f"export {variable}=<a folder> (it is created if missing), or unset it"))
    return path


COMPILE_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
"""Where torch's inductor keeps its compiled graphs (FX graph and AOTAutograd caches, generated kernels;
torch/_inductor/runtime/cache_dir_utils.py, cache_dir, read at each compile; torch 2.13.0). A value the user set
wins."""


def compile_cache_dir() -> Path:
    """Where `training.compile` keeps the compiler's cache between runs: the user's TORCHINDUCTOR_CACHE_DIR, else
    <cache_dir>/compile (inductor's own default is under /tmp, which clusters clear between jobs)."""
    if os.environ.get(COMPILE_CACHE_ENV):
        return folder_from_environment(COMPILE_CACHE_ENV, os.environ[COMPILE_CACHE_ENV])
    return cache_dir() / "compile"
