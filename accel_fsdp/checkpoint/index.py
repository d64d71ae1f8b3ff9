"""The checkpoints on disk, found and judged without torch: which step folders a run has, whether each is complete
(its manifest, every file with its size; with a CRC-32 check on request), the newest complete one, the one a resume
reads and whether this recipe may resume from it, and what `checkpoint inspect` reports.

It reads manifests, trainer states and saved recipes, and never writes: checkpoints are written, rotated and loaded
by store.py. It must never import torch at import time (`run/folder.py` decides a start from it, and `checkpoint
inspect` answers at once).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from accel_fsdp.checkpoint.records import FORMAT, DamagedRecord, Manifest
from accel_fsdp.config.binder import bind
from accel_fsdp.config.recipe import DataConfig, incompatible_keys, read_saved_recipe
from accel_fsdp.data.identity import data_changes, data_identity, weights_fingerprint
from accel_fsdp.errors import Problem, UserError
from accel_fsdp.files import crc32_of
from accel_fsdp.layout import (
    MANIFEST,
    RECIPE_FILE,
    STEP_PREFIX,
    TMP_PREFIX,
    RunLayout,
    checkpoint_step,
    existing_folder,
)


def damaged_files(info: CheckpointInfo, accelerator=None) -> list[str]:
    """The files of a checkpoint whose CRC-32 differs from the one its manifest recorded. With an `accelerator`
    (collective), the ranks share the reading and all get the answer."""
    sums = info.manifest.crc32
    names = sorted(sums)
    world = accelerator.num_processes if accelerator is not None else 1
    rank = accelerator.process_index if accelerator is not None else 0
    bad = [n for i, n in enumerate(names) if i % world == rank and crc32_of(info.path / n) != sums[n]]
    if world > 1:
        from accelerate.utils import gather_object

        bad = sorted(n for part in gather_object([bad]) for n in part)
    return bad


def damage_reason(files: list[str]) -> str:
    """Why a checkpoint whose `files` fail their CRC-32 is not usable, as inspect and resume say it."""
    return (f"{', '.join(files[:5])}{' and more' if len(files) > 5 else ''} changed since it was saved (CRC-32 "
            "differs from the manifest's)")


def verify_files(info: CheckpointInfo, accelerator=None) -> None:
    """Compare every file of a checkpoint with the CRC-32 its manifest recorded; raise a UserError naming the damaged
    file(s) before anything reads them. With an `accelerator` (collective), the ranks share the reading."""
    bad = damaged_files(info, accelerator)
    if bad:
        earlier = [c for c in list_checkpoints(info.path.parent) if c.complete and (c.step or 0) < (info.step or 0)]
        fix = (f"use the previous complete checkpoint, {earlier[-1].path}" if earlier else
               "no earlier checkpoint is complete: restore the file, or start again")
        raise UserError(Problem(str(info.path), damage_reason(bad), fix))


@dataclass
class CheckpointInfo:
    path: Path
    step: int | None
    complete: bool
    reason: str = ""
    """Why it is not complete."""
    manifest: Manifest | None = None
    """Its manifest when one could be read (also for some incomplete ones: another format, a missing file)."""
    @property
    def name(self) -> str:
        return self.path.name


def inspect_checkpoint(path: Path, *, verify: bool = False) -> CheckpointInfo:
    """Read the manifest and check every file it lists is there with its size; with `verify`, also its CRC-32. One
    that goes while it is inspected (a live run's rotation) is incomplete, and says so."""
    path = Path(path)
    try:
        return _inspect(path, verify)
    except FileNotFoundError:
        return CheckpointInfo(path, checkpoint_step(path.name), False, "removed while it was read (its run's "
                              "rotation of old checkpoints)")


def _inspect(path: Path, verify: bool) -> CheckpointInfo:
    step = checkpoint_step(path.name)
    manifest_path = path / MANIFEST
    if path.name.startswith(".tmp-"):
        return CheckpointInfo(path, step, False, "a save that never finished (temporary folder)")
    if not manifest_path.is_file():
        return CheckpointInfo(path, step, False, f"no {MANIFEST} (the save did not finish, or not a checkpoint)")
    try:
        manifest = Manifest.read(path)
    except DamagedRecord as e:
        return CheckpointInfo(path, step, False, e.reason)
    if manifest.format != FORMAT:
        return CheckpointInfo(path, step, False, f"unknown format {manifest.format!r}", manifest)
    for rel, size in manifest.files.items():
        f = path / rel
        if not f.is_file():
            return CheckpointInfo(path, manifest.step, False, f"{rel} is missing", manifest)
        if f.stat().st_size != size:
            return CheckpointInfo(path, manifest.step, False,
                                  f"{rel} has {f.stat().st_size} bytes, the manifest says {size}", manifest)
    if verify:
        for rel, crc in manifest.crc32.items():
            if crc32_of(path / rel) != crc:
                return CheckpointInfo(path, manifest.step, False, damage_reason([rel]), manifest)
    return CheckpointInfo(path, manifest.step, True, "", manifest)


def list_checkpoints(root: Path) -> list[CheckpointInfo]:
    """All step-* folders under `root`, oldest first, each checked."""
    root = Path(root)
    if not root.is_dir():
        return []
    infos = [inspect_checkpoint(p) for p in root.iterdir() if p.is_dir() and checkpoint_step(p.name) is not None]
    return sorted(infos, key=lambda c: c.step or -1)


def latest_complete(root: Path) -> CheckpointInfo | None:
    complete = [c for c in list_checkpoints(root) if c.complete]
    return complete[-1] if complete else None


def names_one_checkpoint(folder: Path) -> bool:
    """A step folder (or one that holds a manifest), not a run folder or a folder of checkpoints."""
    return (checkpoint_step(folder.name) is not None or folder.name.startswith(TMP_PREFIX + STEP_PREFIX)
            or (folder / MANIFEST).exists())


def resolve_checkpoint(path: str | Path, *, what: str = "checkpoint", verify: bool = False,
                       hold: Callable[[Path], bool] | None = None) -> ResumePoint:
    """A checkpoint folder (refused when damaged: it was asked for), or a run folder / checkpoints folder: its newest
    complete checkpoint, with `verify` its newest whose files also match their CRC-32s, and the newer ones passed
    over (a file missing, cut short or, with `verify`, changed since), as a resume goes back past them."""
    p = existing_folder(path, what=what)
    if names_one_checkpoint(p):
        if hold is not None:
            hold(p)
        info = inspect_checkpoint(p, verify=verify)
        if not info.complete:
            raise UserError(Problem(str(p), f"incomplete or corrupt checkpoint: {info.reason}",
                                    "use an earlier complete checkpoint (see `accel-fsdp checkpoint inspect` "
                                    "on the run folder)"))
        return ResumePoint(info, [])
    for candidate in checkpoint_folders_of(p):
        found = newest_intact(candidate, verify_up_to=float("inf") if verify else -1, hold=hold)
        if found.checkpoint is not None:
            return found
    seen = [c for r in checkpoint_folders_of(p) for c in list_checkpoints(r)]
    detail = "; ".join(f"{c.name}: {c.reason}" for c in seen) or "no step-NNNNNN folders"
    fix = ("every checkpoint here is damaged or incomplete: restore one, or train again" if seen else
           "give a run folder that has saved checkpoints (checkpoint.every_steps, or a finished run)")
    raise UserError(Problem(str(p), f"no complete checkpoint found ({detail})", fix))


def checkpoint_folders_of(path: Path) -> list[Path]:
    """Where a run folder keeps its checkpoints (its run.json knows, also when checkpoint.dir moved them: see
    RunLayout.at), then the folder itself (a checkpoint folder given directly)."""
    return list(dict.fromkeys(p.resolve() for p in (RunLayout.at(path).checkpoints, Path(path))))


@dataclass
class ResumePoint:
    """The checkpoint a resume reads (None: none is usable), and the newer ones it passed over, each with why."""

    checkpoint: CheckpointInfo | None
    passed_over: list[CheckpointInfo]

    def notes(self) -> list[str]:
        """What the person resuming is told: which checkpoints were passed over and why, and which is read."""
        return [f"{c.name} is newer but not usable ({c.reason}): continuing from {self.checkpoint.name}"
                for c in self.passed_over]


def checkpoint_to_resume(root: Path, resume_from: str | None, *, accelerator=None,
                         verify_up_to: float = float("inf")) -> ResumePoint:
    """--resume-from PATH (a damaged one is refused: it was asked for), or --resume / --resume auto: the newest
    checkpoint under the run's checkpoint folder that is complete and whose files match their CRC-32s. A newer one
    that is not is passed over and said, whether a save never finished (a file missing or short) or a file changed
    since (same size, other bytes): both are damage the run survives by going back to the previous checkpoint (and
    the ranks keep the damaged one aside: train/checkpointing.py).

    The files of a checkpoint larger than `verify_up_to` bytes are not read here (the ranks read them, in parallel).
    With an `accelerator` (collective), the ranks share the reading."""
    if resume_from:
        info = resolve_checkpoint(resume_from).checkpoint
        if info.manifest.total_bytes <= verify_up_to:
            verify_files(info, accelerator)
        return ResumePoint(info, [])
    found = newest_intact(root, accelerator=accelerator, verify_up_to=verify_up_to)
    if found.checkpoint is not None:
        return found
    skipped = [f"{c.name} ({c.reason})" for c in reversed(found.passed_over)]
    raise UserError(Problem(str(root), "--resume found no complete checkpoint" +
                            (f"; not usable: {', '.join(skipped)}" if skipped else ""),
                            "restore a damaged checkpoint, or drop --resume and add --overwrite to start over"))


def newest_intact(root: Path, *, accelerator=None, verify_up_to: float = float("inf"),
                  hold: Callable[[Path], bool] | None = None) -> ResumePoint:
    """The newest checkpoint under `root` that is complete and whose files match their CRC-32s (not read for one
    larger than `verify_up_to` bytes; None when there is none), with the newer ones passed over and why. With an
    `accelerator` (collective), the ranks share the reading. `hold`: called with each complete one before its files
    are read (a reader's lock against rotation, store.py `reading`); False: it is gone, and passed by."""
    passed_over = []
    for info in reversed(list_checkpoints(root)):
        if info.complete and hold is not None and not hold(info.path):
            continue
        if info.complete and info.manifest.total_bytes <= verify_up_to:
            bad = damaged_files(info, accelerator)
            if bad:
                info = dataclasses.replace(info, complete=False, reason=damage_reason(bad))
        if info.complete:
            return ResumePoint(info, passed_over)
        passed_over.append(info)
    return ResumePoint(None, passed_over)


def check_resume(info: CheckpointInfo, recipe, settings, total_steps: int | None = None, *,
                 accept_data_change: bool = False) -> list[str]:
    """Refuse a checkpoint of another model or an incompatible recipe, one past the run's last step (`total_steps`:
    the recipe's max_steps, or what its epochs come to; None when not known yet), or one whose data changed since
    (unless `accept_data_change`: --accept-data-change); return notes for what changes safely."""
    saved = read_saved_recipe(info.path / RECIPE_FILE, then=", so the recipe that made this checkpoint is unknown",
                              fix="use another checkpoint")
    diff = incompatible_keys(saved, recipe.to_dict())
    if diff:
        lines = [f"{k}: checkpoint has {old!r}, this run has {new!r}" for k, old, new in diff]
        raise UserError(Problem(str(info.path), "was made by an incompatible recipe:\n      " + "\n      ".join(lines),
                                "resume with the recipe that made it (the checkpoint keeps a copy in recipe.yaml), "
                                "or start a new run (another --output-dir) and load the consolidated export as "
                                "model.name_or_path"))
    m = info.manifest
    _check_starting_weights(info, recipe)
    changed = data_changes(m.data or {}, data_identity(recipe))
    if changed and not accept_data_change:
        raise UserError(Problem(str(info.path), "the data changed since this checkpoint was saved:\n      "
                                + "\n      ".join(changed), "resume with the data as it was (restore the file), or add "
                                "--accept-data-change to go on with the data as it is now (its units are read in a "
                                "new order from here on); nothing was changed"))
    if total_steps is not None and m.step > total_steps:
        key = "training.max_steps" if recipe.training.max_steps is not None else "training.epochs"
        raise UserError(Problem(recipe.where(key), f"this run would end at step {total_steps:,}, before its "
                                f"checkpoint {info.path.name} (step {m.step:,}): resuming cannot go back",
                                f"set {key} to reach beyond step {m.step:,} to train on, or use the checkpoint as it "
                                "is (accel-fsdp checkpoint consolidate); nothing was changed"))
    notes = []
    if m.fsdp_version != settings.fsdp_version.value:
        raise UserError(Problem(str(info.path), f"was written with FSDP{m.fsdp_version}, this run uses "
                                f"FSDP{settings.fsdp_version.value}; their optimizer states are not interchangeable",
                                f"resume with an FSDP{m.fsdp_version} accelerate config, or consolidate it "
                                "and start a new run from the export"))
    if changed:
        notes.append("the data changed since the checkpoint; going on with it as it is now (--accept-data-change): "
                     + "; ".join(changed))
    if m.world_size != settings.num_processes.value:
        notes.append(f"resharding from {m.world_size} to {settings.num_processes.value} ranks "
                     f"({m.state_dict_type} allows it); the data order is unchanged, the dropout RNG of "
                     "ranks without a saved state restarts from the seed")
    notes += _schedule_notes(saved, recipe)
    return notes


def _schedule_notes(saved: dict, recipe) -> list[str]:
    """A run made longer or shorter on resume (training.max_steps, training.epochs may change) keeps its optimizer
    state, but its decaying lr schedule is computed for the new end from here on: said, since the lr of the next
    step then differs from what the checkpoint's run would have used."""
    t = recipe.training
    then = saved.get("training", {})
    if t.scheduler == "constant":
        return []
    return [f"training.{key}: {then.get(key)!r} then, {getattr(t, key)!r} now; the {t.scheduler} lr schedule decays "
            "towards the new end from here on" for key in ("max_steps", "epochs") if then.get(key) != getattr(t, key)]


def _check_starting_weights(info: CheckpointInfo, recipe) -> None:
    """A checkpoint that holds only against the weights its run started from (data/identity.py
    `starting_weights_record`) is refused once they changed: LoRA adapters would go on over another base, a DPO
    policy against a reference computed from other weights (train/reference.py computes it again from the model
    files), and the run would not say so. The usual cause: the SFT run it started from was resumed or run again,
    writing a new final/."""
    saved = info.manifest.starting_weights
    if not saved:
        return
    now = weights_fingerprint(recipe)
    if now is None or now == saved:
        return
    what = ("its LoRA adapters were trained over" if recipe.model.lora.enabled
            else f"its {recipe.training.method} reference was computed from")
    raise UserError(Problem(recipe.where("model.name_or_path"),
                            f"the model {recipe.model.name_or_path!r} changed since the checkpoint {info.path} was "
                            f"saved ({what} the weights as they were then; fingerprint {saved}, now {now})",
                            "resume with the model files the run started from (put them back), or start a new run "
                            "from the model as it is now (another --output-dir); nothing was changed"))


def check_quantized_base(info: CheckpointInfo, current: dict | None) -> None:
    """A checkpoint of a run with a 4-bit base holds the adapters only: the base is rebuilt from the model files on
    resume and must be the one the adapters were trained on (model/quantize.py QuantizedBase, its fingerprint)."""
    saved = info.manifest.quantized_base
    if not saved or not current or saved.get("fingerprint") == current.get("fingerprint"):
        return
    versions = (f" (torchao {saved.get('torchao')} then, {current.get('torchao')} now)"
                if saved.get("torchao") != current.get("torchao") else "")
    raise UserError(Problem(str(info.path), f"its adapters were trained on a 4-bit base ({saved.get('method')}) with "
                            f"fingerprint {saved.get('fingerprint')}, and the base rebuilt from the model files now "
                            f"has fingerprint {current.get('fingerprint')}{versions}: the model files or their "
                            "quantization changed",
                            "resume with the model files (and torchao) the run started with, or start a new run "
                            "(another --output-dir)"))


@dataclass
class SourceSummary:
    """One data source of the recipe that made a checkpoint."""

    name: str
    path: str
    share: float
    """Its weight over the sum of the weights."""


@dataclass
class RecipeSummary:
    """The recipe that made a checkpoint, in brief (its recipe.yaml has all of it)."""

    name: str | None
    model: str | None
    data: str | None
    """The data path of a single source; None for a mixture (see `sources`)."""
    sources: list[SourceSummary]
    global_batch_size: int | None
    max_steps: int | None
    lr: float | None


@dataclass
class CheckpointDescription:
    """What `accel-fsdp checkpoint inspect` reports of a checkpoint (the CLI words it; --json prints `to_dict`)."""

    path: str
    complete: bool
    problem: str
    """Why it is not complete ('' when it is)."""
    step: int | None
    epoch: int | None
    world_size: int | None
    state_dict_type: str | None
    fsdp_version: int | None
    lora: bool | None
    parameters: int | None
    trainable_parameters: int | None
    bytes: int
    files: int
    created: str | None
    recipe_fingerprint: str | None
    recipe: RecipeSummary | None
    """None where the checkpoint holds no recipe.yaml; a name saying so where it is unreadable."""

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        if self.complete:
            del out["problem"]
        if self.recipe is None:
            del out["recipe"]
        return out


def describe(info: CheckpointInfo) -> CheckpointDescription:
    """What `accel-fsdp checkpoint inspect` reports: its manifest, and the recipe that made it."""
    m = info.manifest or Manifest(step=info.step, format=None)  # no (readable) manifest: only the folder's step
    return CheckpointDescription(
        path=str(info.path), complete=info.complete, problem="" if info.complete else info.reason, step=m.step,
        epoch=m.epoch, world_size=m.world_size, state_dict_type=m.state_dict_type, fsdp_version=m.fsdp_version,
        lora=m.lora, parameters=m.parameters, trainable_parameters=m.trainable_parameters, bytes=m.total_bytes,
        files=len(m.files), created=m.created, recipe_fingerprint=m.recipe_fingerprint,
        recipe=_recipe_summary(info.path / RECIPE_FILE))


def _recipe_summary(recipe_file: Path) -> RecipeSummary | None:
    if not recipe_file.exists():
        return None
    problems: list[Problem] = []
    try:
        saved = read_saved_recipe(recipe_file)
        data = bind(DataConfig, saved.get("data", {}), "data.", str, problems)
    except UserError:
        problems.append(Problem(str(recipe_file), "unreadable"))
    if problems:
        return RecipeSummary(name=f"({RECIPE_FILE} unreadable)", model=None, data=None, sources=[],
                             global_batch_size=None, max_steps=None, lr=None)
    sources = data.resolved_sources()
    total = sum(s.weight for s in sources) or 1.0
    model, training = saved.get("model", {}), saved.get("training", {})
    return RecipeSummary(name=saved.get("name"), model=model.get("name_or_path") or model.get("architecture"),
                         data=data.path or None, sources=[SourceSummary(s.name, s.path, s.weight / total)
                                                          for s in sources],
                         global_batch_size=training.get("global_batch_size"), max_steps=training.get("max_steps"),
                         lr=training.get("lr"))
