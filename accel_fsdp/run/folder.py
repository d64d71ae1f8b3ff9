"""The run folder: who owns it, what a start does with it, and the guard that keeps runs from hurting each other.
Where each file of a run lives is layout.py's (`RunLayout`).

Ownership: a run gets an id when it is created (run.json), and its checkpoint folder records the same id
(`<checkpoints>/.accel-fsdp-run`), as does every checkpoint's manifest. A run never writes into, resumes from or
deletes a checkpoint folder of another run; `--overwrite` deletes only files it can prove belong to the run it
replaces. One live run per folder: the main process holds a lock on the run folder and on the checkpoint folder for
the life of the run. This module decides; it never touches torch.
"""

from __future__ import annotations

import json
import os
import sys
import time
from enum import Enum
from pathlib import Path

from accel_fsdp.checkpoint.index import list_checkpoints
from accel_fsdp.checkpoint.records import Manifest
from accel_fsdp.config.recipe import incompatible_keys, read_saved_recipe
from accel_fsdp.errors import Problem, UserError
from accel_fsdp.files import FileLock, discard_folder, fsync_dir, remove, remove_dead_temporaries, write_atomic

# The paths of a run are layout.py's; this module decides what a start may do with them.
from accel_fsdp.layout import (
    CHECKPOINT_PREFIXES,
    LOCK_FILE,
    OWNER_FILE,
    RUN_FOLDER_ENTRIES,
    STEP_PREFIX,
    TRASH_PREFIX,
    RunIdentity,
    RunLayout,
    checkpoint_step,
    checkpoints_of,
    dangling_link_problem,
    existing_folder,
)


class Decision(str, Enum):
    """What a start does with the run folder."""
    NEW = "new"
    """Start a new run (the folder is new or empty)."""
    RESUME = "resume"
    """Continue this run from a checkpoint."""
    OVERWRITE = "overwrite"
    """Replace the run here with a new one (its own files are deleted first)."""
    RESTART = "restart"
    """--resume auto on a run that never saved a checkpoint (no step folder): start it again from step 0 (same id).
    One whose checkpoints are all damaged is resumed, and the resume stops, naming each and why: nothing is
    deleted, and the user chooses (restore one, or --overwrite)."""


# ------------------------------------------------------------------------------------------- the decision


def decide(layout: RunLayout, recipe, *, resume: str | None = None, resume_from: Path | str | None = None,
           overwrite: bool = False) -> Decision:
    """What this start does with the run folder, or a UserError saying why it must not start (nothing changed).

    `resume`: None, "latest" (--resume: continue from the newest complete checkpoint; there must be one) or
    "auto" (--resume auto: continue this run if it has a complete checkpoint, else start it; refuse another run).
    `resume_from`: a checkpoint folder to start from, into a new folder or into the run that made it."""
    root = layout.root
    if root.exists() and not root.is_dir():
        raise UserError(Problem(str(root), "exists and is not a folder", "choose another --output-dir"))
    identity = RunIdentity.read(layout.run_file) if layout.run_file.is_file() else None
    if identity is None:
        if root.exists() and _foreign_entries(root):
            raise UserError(Problem(str(root), "is not empty and does not hold an accel-fsdp run",
                                    "choose another --output-dir (nothing was changed)"))
        if resume == "latest":
            raise UserError(Problem(str(root), "--resume was given, but there is no run here to resume",
                                    "drop --resume to start a new run, use --resume auto (resume if possible, else "
                                    "start), or give the --output-dir of the run to resume"))
        check_checkpoint_folder(layout, owner=None)
        return Decision.NEW
    if overwrite:
        check_checkpoint_folder(layout, owner=identity)
        return Decision.OVERWRITE
    if resume_from:
        theirs = checkpoint_run_id(existing_folder(resume_from))  # a missing one is named as missing
        if theirs != identity.run_id:
            raise UserError(Problem(str(root), f"holds {identity.describe()}, but {resume_from} belongs to run "
                                    f"{theirs or '(unknown)'}; --resume-from would write this other run's training "
                                    "into it", "give a new --output-dir to start a run from that checkpoint "
                                    "(nothing was changed)"))
        check_checkpoint_folder(layout, owner=identity)
        return Decision.RESUME
    if resume in ("latest", "auto") and not layout.checkpoints.exists():
        _refuse_missing_checkpoint_folder(layout, identity)
    if resume == "latest":
        check_checkpoint_folder(layout, owner=identity)
        return Decision.RESUME
    if resume == "auto":
        differences = _recipe_differences(layout, recipe)
        if differences:
            raise UserError(Problem(str(root), f"holds another run ({identity.describe()}), made by a recipe that "
                                    "differs in what is trained:\n      " + "\n      ".join(differences),
                                    "give another --output-dir, or resume it with the recipe that made it "
                                    "(its copy is in recipe.yaml) (nothing was changed)"))
        check_checkpoint_folder(layout, owner=identity)
        # Any step folder, intact or not: a checkpoint cut short and one whose bytes changed (the same size: only
        # reading it tells) end alike, in the resume: from the newest intact one, or a stop naming each.
        return Decision.RESUME if list_checkpoints(layout.checkpoints) else Decision.RESTART
    same = identity.recipe_fingerprint == recipe.fingerprint()
    what = ("a run of this same recipe" if same else
            f"a different run (recipe {identity.recipe_name!r}, fingerprint {identity.recipe_fingerprint})")
    raise UserError(Problem(str(root), f"already holds {what}",
                            "add --resume to continue it, --overwrite to replace it, or choose another --output-dir "
                            "(nothing was changed)"))


def _refuse_missing_checkpoint_folder(layout: RunLayout, identity: RunIdentity) -> None:
    """Every start of a run creates its checkpoint folder (`apply_decision`): a run folder whose checkpoint folder is
    gone had it moved or deleted, most often a run folder moved with an absolute checkpoint.dir inside it. `--resume
    auto` took it for a run that saved no checkpoint and started it again from step 0 over its metrics and final/."""
    moved = [p for p in sorted(layout.root.iterdir())
             if p.is_dir() and (read_owner(p) or {}).get("run_id") == identity.run_id]
    where = (f"it holds {moved[0]}: resume with --set checkpoint.dir='{moved[0]}'" if moved else
             "set checkpoint.dir to where they are now")
    raise UserError(Problem(str(layout.checkpoints), "this run's checkpoint folder does not exist (moved or deleted "
                            f"since the run saved into it; the run folder {layout.root} holds the run)",
                            f"{where}, or add --overwrite to start the run over (nothing was changed)"))


def check_checkpoint_folder(layout: RunLayout, *, owner: RunIdentity | None) -> None:
    """The checkpoint folder may be used by this run: it is missing or empty, or it belongs to `owner` (the run in
    the run folder). A folder of another run, or one holding anything not made by this run, is refused."""
    folder = layout.checkpoints
    if not folder.exists():
        return
    if not folder.is_dir():
        raise UserError(Problem(str(folder), "checkpoint.dir is not a folder", "set checkpoint.dir to a folder"))
    recorded = read_owner(folder)
    if recorded is not None:
        if owner is not None and recorded.get("run_id") == owner.run_id:
            return
        raise UserError(Problem(str(folder), f"this checkpoint folder belongs to another run (run "
                                f"{recorded.get('run_id')} in {recorded.get('run_dir')})",
                                "set checkpoint.dir to a folder of this run's own (nothing was changed)"))
    entries = _foreign_entries(folder)
    if not entries:
        return
    raise UserError(Problem(str(folder), f"the checkpoint folder is not empty ({', '.join(sorted(entries)[:3])}) "
                            "and records no run that owns it", "set checkpoint.dir to an empty or new folder "
                            "(nothing was changed)"))


def read_owner(folder: Path) -> dict | None:
    try:
        data = json.loads((folder / OWNER_FILE).read_text())
        return data if isinstance(data, dict) else {"run_id": "(corrupt owner file)"}
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, ValueError):
        return {"run_id": "(corrupt owner file)", "run_dir": str(folder)}


def checkpoint_run_id(path: Path) -> str | None:
    """The run id a checkpoint's manifest records (None when it cannot be read)."""
    try:  # unchecked: whose it is can be told from a manifest that is otherwise damaged (resuming will refuse it)
        return Manifest.read(Path(path), checked=False).run_id
    except UserError:
        return None


def _recipe_differences(layout: RunLayout, recipe) -> list[str]:
    try:
        saved = read_saved_recipe(layout.recipe_file)
    except UserError:
        return [f"{layout.recipe_file} is missing or unreadable"]
    differences = incompatible_keys(saved, recipe.to_dict())
    return [f"{k}: that run has {old!r}, this one {new!r}" for k, old, new in differences]


def _foreign_entries(folder: Path) -> list[str]:
    """What a folder holds besides our lock and owner files."""
    return [p.name for p in folder.iterdir() if p.name not in (LOCK_FILE, OWNER_FILE)]


# ------------------------------------------------------------------------------------- carrying it out


def apply_decision(layout: RunLayout, recipe, settings, decision: Decision, *,
                   resumed_from: str | None = None) -> RunIdentity:
    """Main process only, holding the locks: carry out the start's decision. Clear what an overwrite or a restart
    replaces (only files this run or the replaced one provably owns), record the identity, claim the checkpoint
    folder."""
    root = layout.root
    old = RunIdentity.read(layout.run_file) if layout.run_file.is_file() else None
    for name in RUN_FOLDER_ENTRIES:  # what an earlier overwrite, killed while deleting it, left aside
        remove_dead_temporaries(root / name)
    if decision in (Decision.OVERWRITE, Decision.RESTART) and old is not None:
        for name in RUN_FOLDER_ENTRIES:
            target = root / name
            if target.is_dir() and not target.is_symlink():
                discard_folder(target)  # whole or gone, if this is killed on the way
            elif target.exists() or target.is_symlink():
                target.unlink()
        folders = {layout.checkpoints}
        if old.checkpoint_dir:
            folders.add(checkpoints_of(root, old.checkpoint_dir))
        for folder in folders:
            owner = read_owner(folder) if folder.is_dir() else None
            if owner is not None and owner.get("run_id") == old.run_id:
                for entry in folder.iterdir():
                    if entry.name.startswith(CHECKPOINT_PREFIXES) and entry.is_dir():
                        if entry.name.startswith(STEP_PREFIX):  # into the store's trash first, whole: its
                            entry = entry.rename(entry.with_name(TRASH_PREFIX + entry.name))  # saves sweep that
                        remove(entry)
    root.mkdir(parents=True, exist_ok=True)
    if decision == Decision.RESUME and old is not None:
        identity = old
    elif decision == Decision.RESTART and old is not None:
        identity = RunIdentity.new(recipe, layout, run_id=old.run_id)
    else:
        identity = RunIdentity.new(recipe, layout, resumed_from=resumed_from)
    identity.checkpoint_dir = layout.recorded_checkpoints
    identity.finished_at = None
    identity.write(layout.run_file)
    layout.preempted_file.unlink(missing_ok=True)  # a record of an earlier stop: this start supersedes it
    layout.checkpoints.mkdir(parents=True, exist_ok=True)
    if decision == Decision.RESUME and resumed_from:
        set_aside_newer(layout, Path(resumed_from))
    write_atomic(layout.checkpoints / OWNER_FILE,
                  json.dumps({"run_id": identity.run_id, "run_dir": str(root)}, indent=1) + "\n")
    write_atomic(layout.recipe_file, recipe.to_yaml())
    write_atomic(layout.settings_file, json.dumps(settings.to_dict(), indent=1, default=str) + "\n")
    return identity


def set_aside_newer(layout: RunLayout, resume_from: Path) -> list[str]:
    """--resume-from an older checkpoint of this run: its newer checkpoints belong to the abandoned continuation.
    Left in place they would outlive every checkpoint this run writes (rotation keeps the highest steps) and a later
    --resume would continue the abandoned run; they are moved into `abandoned-<time>/` of the checkpoint folder,
    where neither rotation nor resume looks. Returns the names moved."""
    start = resume_from.expanduser().resolve()
    first = checkpoint_step(start.name)
    if start.parent != layout.checkpoints.resolve() or first is None:
        return []  # a checkpoint of another folder, or a run folder (its newest checkpoint: nothing is newer)
    newer = sorted((p for p in layout.checkpoints.iterdir() if p.is_dir() and (checkpoint_step(p.name) or -1) > first),
                   key=lambda p: checkpoint_step(p.name))
    if not newer:
        return []
    aside = move_aside(layout.checkpoints, newer, ABANDONED)
    names = [p.name for p in newer]
    print(f"resume: {len(names)} newer checkpoint(s) of the continuation abandoned by --resume-from "
          f"({names[0]} to {names[-1]}) moved to {aside}", file=sys.stderr, flush=True)
    return names


ABANDONED, DAMAGED = "abandoned", "damaged"
"""The kinds of step folders a start moves aside, and the first word of the folder they go into."""


def move_aside(checkpoints: Path, folders: list[Path], kind: str) -> Path:
    """Move step folders into `<checkpoints>/<kind>-<time>/` (kind: ABANDONED or DAMAGED), and return that folder. They
    are kept there: rotation and resume look only at the step folders at the top, and nothing of accel-fsdp deletes
    them but an --overwrite of the run (which replaces the run folder's checkpoints/ whole; in a checkpoint.dir of its
    own, only the step folders: layout.CHECKPOINT_PREFIXES). A rename in the same folder: atomic, no copy."""
    stamp = time.strftime(f"{kind}-%Y%m%d-%H%M%S")
    aside, again = checkpoints / stamp, 1
    while aside.exists():  # set aside twice within a second: a folder of its own, nothing replaced
        again += 1
        aside = checkpoints / f"{stamp}-{again}"
    aside.mkdir()
    for folder in folders:
        os.replace(folder, aside / folder.name)
    fsync_dir(checkpoints)
    return aside


# ---------------------------------------------------------------------------------------------------- lock


class FolderLock:
    """A folder claimed for the life of this process: files.FileLock on `<folder>/.accel-fsdp.lock`, the folder
    created if need be (and removed again by a start that was refused)."""
    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.created = False
        self.lock = FileLock(self.folder / LOCK_FILE)

    @property
    def path(self) -> Path:
        return self.lock.path

    def acquire(self, what: str) -> FolderLock:
        """Take the lock, creating the folder if needed; a UserError naming the holder if another run has it."""
        if not self.folder.exists():
            self.folder.mkdir(parents=True)
            self.created = True
        if not self.lock.acquire(wait=False):
            raise UserError(Problem(str(self.folder), f"this {what} is in use by a live run "
                                    f"({self.lock.holder() or 'held by another process'})",
                                    "wait for it to finish (or stop it), or choose another folder (nothing was "
                                    "changed)"))
        return self

    def release(self, *, remove_if_created: bool = False) -> None:
        self.lock.release()
        if remove_if_created and self.created:
            try:
                self.path.unlink(missing_ok=True)
                self.folder.rmdir()  # only if nothing else was written
            except OSError:
                pass


def lock_holder(folder: Path) -> str | None:
    """Who holds the lock of `folder` right now (host, PID, since when), or None. Takes nothing."""
    return FileLock(Path(folder) / LOCK_FILE).holder()


def lock_problems(layout: RunLayout) -> list[Problem]:
    """Before launching: a live run holding the run folder or the checkpoint folder."""
    out = []
    for folder, what in ((layout.root, "run folder"), (layout.checkpoints, "checkpoint folder")):
        holder = lock_holder(folder)
        if holder:
            out.append(Problem(str(folder), f"this {what} is in use by a live run ({holder})",
                               "wait for it to finish (or stop it), or choose another folder (nothing was changed)"))
    return out[:1] if len(out) == 2 and not layout.external_checkpoints else out


def writable_problems(layout: RunLayout) -> list[Problem]:
    """The run folder and checkpoint folder can be created and written (checked before launching)."""
    out, links_to_nothing = [], False
    folders = [(layout.root, "--output-dir")] + [(layout.checkpoints, "checkpoint.dir")] * layout.external_checkpoints
    for folder, key in folders:
        existing = folder
        while not existing.exists() and existing != existing.parent:
            if dangling_link_problem(existing) is not None:
                break
            existing = existing.parent
        if (dangling := dangling_link_problem(existing)) is not None:
            links_to_nothing = True
            out.append(Problem(str(folder), f"{existing} {dangling.message}",
                               f"choose another {key}, or point the link at a folder that exists"))
        elif file_in_the_way(folder):
            out.append(Problem(str(folder), f"{existing} is a file, not a folder", f"choose another {key}"))
        elif existing.exists() and not os.access(existing, os.W_OK | os.X_OK):
            out.append(Problem(str(folder), f"cannot be written: {existing} is not writable by this user",
                               f"choose a writable {key}, or fix the permissions of {existing}"))
        elif existing.exists() and (error := _cannot_create_in(existing)):
            out.append(Problem(str(folder), f"cannot be written: creating a folder in {existing} fails ({error})",
                               f"choose another {key}"))
    if links_to_nothing:  # resolve() below raises RuntimeError on a loop of links
        return out
    final, checkpoints, root = layout.final.resolve(), layout.checkpoints.resolve(), layout.root.resolve()
    if checkpoints == root or checkpoints in root.parents:
        out.append(Problem(f"checkpoint.dir: {layout.checkpoints}", f"is the run folder {layout.root} or a folder "
                           "above it: the step folders and their rotation would sit among the files of the run (or of "
                           "other runs)", "choose a folder of its own, e.g. checkpoints (inside the run folder)"))
    elif final == checkpoints or final in checkpoints.parents:
        out.append(Problem(f"checkpoint.dir: {layout.checkpoints}", "is the exported model's folder (final/) or inside "
                           "it: the export at the end replaces final/", "choose another folder, e.g. "
                           "checkpoints"))
    return out


def file_in_the_way(folder: Path) -> Path | None:
    """The file at `folder` or at the nearest of its parents that exists, where a folder must be made."""
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    return existing if existing.exists() and not existing.is_dir() else None


def _cannot_create_in(folder: Path) -> str | None:
    """Why a folder cannot be created in `folder`, found by creating one and removing it (permission bits do not
    say it for root, a read-only mount or a pseudo filesystem such as /proc)."""
    import tempfile

    try:
        os.rmdir(tempfile.mkdtemp(prefix=".accel-fsdp-probe-", dir=folder))
    except OSError as e:
        return e.strerror or type(e).__name__
    return None
