"""Checkpoints: complete training state, written atomically, described by a manifest, resumable exactly.

Layout of `<run>/checkpoints/step-000200/`:
    manifest.json          step, world size, state-dict type, recipe hash, run id, every file with its size and
                           CRC-32 (computed at save time, split over the ranks; checked before a resume reads it)
    trainer_state.json     step, epoch and position in the data, LR scheduler, tokens seen, the open logging window
    recipe.yaml            the resolved recipe; fsdp_settings.json the effective FSDP settings
    pytorch_model_fsdp_0/  model: torch.distributed.checkpoint shards (SHARDED_STATE_DICT; also readable by
                           `accelerate merge-weights`), or pytorch_model_fsdp.bin (FULL_STATE_DICT)
    optimizer_0/           optimizer state, same type (optimizer.bin for FULL_STATE_DICT)
    rng_state_<rank>.pt    RNG states of every rank; scaler.pt for fp16
    hf/                    config.json, generation_config.json, tokenizer files, adapter_config.json (LoRA):
                           what `accel-fsdp checkpoint consolidate` needs to write a Hugging Face folder

A run with a 4-bit base (model.quantize) saves the adapters and their optimizer state only, like any LoRA run: the
base is rebuilt from the model files, and the manifest's `quantized_base` fingerprint checks it on resume.

Atomicity: every rank writes into `.tmp-step-000200/`; after all ranks finished, rank 0 writes the manifest
and renames the folder. A crash (even SIGKILL) before the rename leaves the previous checkpoint untouched and
the temporary folder ignored (and removed by the next save). A folder without a valid manifest, or whose
files do not match it, is never resumed from.

The model and optimizer are saved with Accelerate's FSDP helpers (`save_fsdp_model`, `save_fsdp_optimizer`),
which use torch.distributed.checkpoint; LoRA runs save only the adapter weights and their optimizer state. Finding
and judging checkpoints (complete or not, the newest complete one, the one to resume) is index.py's, without torch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from accel_fsdp import __version__
from accel_fsdp.checkpoint.index import (
    CheckpointInfo,
    ResumePoint,
    latest_complete,
    list_checkpoints,
    resolve_checkpoint,
)
from accel_fsdp.checkpoint.records import FORMAT, DamagedRecord, Manifest, TrainerState, damaged_if_unreadable
from accel_fsdp.errors import Problem, UserError, first_line
from accel_fsdp.files import FileLock, crc32_of, fsync_dir, write_atomic

# A checkpoint's file names live with every other path of a run, in layout.py.
from accel_fsdp.layout import (
    HF_DIR,
    MANIFEST,
    READING_PREFIX,
    RECIPE_FILE,
    SCALER_FILE,
    SETTINGS_FILE,
    STEP_PREFIX,
    TMP_PREFIX,
    TRAINER_STATE,
    TRASH_PREFIX,
    checkpoint_name,
    checkpoint_step,
    reading_lock,
    rng_file,
)


# --------------------------------------------------------------------------------------------------- save


def save_checkpoint(accelerator, model, optimizer, scheduler, *, root: Path, step: int,
                    trainer_state: TrainerState,
                    recipe, settings, tokenizer, lora: bool, keep_last: int | None, faults=None,
                    run_id: str | None = None, data_identity: dict | None = None,
                    quantized_base: dict | None = None, starting_weights: str | None = None) -> Path:
    """Write the checkpoint of optimizer step `step` atomically; rotate old ones. Collective: all ranks call it.
    The scheduler's state is added to `trainer_state` here. `data_identity`, `starting_weights`: what the run's data
    and the weights it started from were (data/identity.py), compared on resume.

    Long: the save is one protocol every rank walks through (temporary folder, shards, barrier, agreement on
    failure, checksums, manifest, rename, barrier); split, its barriers would hide in helpers."""
    from accelerate.utils import save_fsdp_model, save_fsdp_optimizer

    name = checkpoint_name(step)
    final, tmp = root / name, root / f"{TMP_PREFIX}{name}"
    main = accelerator.is_main_process
    error: BaseException | None = None
    if main:
        try:
            root.mkdir(parents=True, exist_ok=True)
            for stale in root.glob(f"{TMP_PREFIX}{STEP_PREFIX}*"):  # left by a crash; never a valid checkpoint
                shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir()
        except OSError as e:  # said below, after every rank tried (and failed) too: the save is collective
            error = e
    accelerator.wait_for_everyone()
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        plugin = accelerator.state.fsdp_plugin
        save_fsdp_model(plugin, accelerator, model, str(tmp), adapter_only=lora)
        save_fsdp_optimizer(plugin, accelerator, optimizer, model, str(tmp))
        torch.save(_rng_state(), tmp / rng_file(accelerator.process_index))
        if faults is not None:
            faults.in_save(step)
        if main:
            if accelerator.scaler is not None:
                torch.save(accelerator.scaler.state_dict(), tmp / SCALER_FILE)
            state = dataclasses.replace(trainer_state, scheduler=scheduler.state_dict())
            (tmp / TRAINER_STATE).write_text(json.dumps(state.to_dict(), indent=1, default=_jsonable))
            (tmp / RECIPE_FILE).write_text(recipe.to_yaml())
            (tmp / SETTINGS_FILE).write_text(json.dumps(settings.to_dict(), indent=1, default=str))
            _save_hf_files(accelerator, model, tokenizer, tmp / HF_DIR)
    except (OSError, CheckpointException) as e:  # DCP reports a failed write on any rank to every rank
        error = error or e
    except RuntimeError as e:  # torch.save's zip writer on a full disk ("unexpected pos"); else a bug: raised
        if _free_bytes(root) >= LOW_DISK:
            raise
        error = error or e
    if accelerator.num_processes > 1:
        from accelerate.utils import gather_object

        failed = [r for r, ok in enumerate(gather_object([error is None])) if not ok]
    else:
        failed = [0] if error else []
    if failed:
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
        previous = latest_complete(root)
        kept = f"the previous checkpoint {previous.path.name} is intact" if previous else "no earlier checkpoint exists"
        cause, fix = _save_error_cause(error, root) if error else (f"rank(s) {failed} failed", _FULL_DISK_FIX)
        raise UserError(Problem(str(final), f"saving the checkpoint failed: {cause}; {kept}", fix),
                        rank_local=error is not None) from None  # the rank that hit the error says why
    accelerator.wait_for_everyone()  # every rank's shards are on disk
    files = {str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()}
    checksums = _checksums_over_ranks(accelerator, tmp, sorted(files))
    if main:
        manifest = Manifest(
            format=FORMAT, step=step, epoch=trainer_state.epoch, world_size=accelerator.num_processes,
            state_dict_type=settings.state_dict_type.value, fsdp_version=settings.fsdp_version.value, lora=lora,
            recipe_fingerprint=recipe.fingerprint(), run_id=run_id, parameters=trainer_state.parameters,
            trainable_parameters=trainer_state.trainable_parameters, created=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            versions=_versions(), data=data_identity, quantized_base=quantized_base,
            starting_weights=starting_weights, files=files, crc32=checksums)
        write_atomic(tmp / MANIFEST, manifest.to_json())
        if final.exists():  # the same step saved again (e.g. the end of a resumed run): replace it
            shutil.rmtree(final)
        os.rename(tmp, final)
        fsync_dir(root)
    accelerator.wait_for_everyone()
    if main:
        # After the barrier, and in the background: deleting large old checkpoints must not hold the other ranks
        # at a barrier (into the collective timeout), nor this one at the next step.
        rotate(root, keep_last, newest=step, background=True)
    return final


def _checksums_over_ranks(accelerator, folder: Path, names: list[str]) -> dict[str, str]:
    """CRC-32 of every file, each rank hashing every world-size-th one (the files were just written: they are read
    back from the page cache). Collective."""
    world, rank = accelerator.num_processes, accelerator.process_index
    mine = {n: crc32_of(folder / n) for i, n in enumerate(names) if i % world == rank}
    if world == 1:
        return mine
    from accelerate.utils import gather_object

    out: dict[str, str] = {}
    for part in gather_object([mine]):
        out.update(part)
    return out


_FULL_DISK_FIX = "free disk space (or set checkpoint.dir to a larger disk) and restart with --resume"


def _save_error_cause(error: BaseException, root: Path) -> tuple[str, str]:
    """(why, fix) of a failed save: the OSError's own words ('No space left on device', 'Permission denied'), from the
    error or from the first failure a DCP CheckpointException carries; else its first line, with the free space of
    the checkpoint folder's disk when that is nearly none (torch.save's writer says only 'unexpected pos')."""
    import errno

    failures = getattr(error, "failures", None)
    if failures:
        error = next(iter(failures.values()))[0]
    if isinstance(error, OSError) and error.strerror:
        if error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            return f"{error.strerror} ({error.filename})", ("make checkpoint.dir writable again (or set it to a "
                                                             "writable folder) and restart with --resume")
        return error.strerror, _FULL_DISK_FIX
    cause = first_line(error)
    free = _free_bytes(root)
    if free < LOW_DISK:
        cause = f"the disk is full ({free / 2**20:.1f} MiB free there; {cause})"
    return cause, _FULL_DISK_FIX


LOW_DISK = 64 * 2**20
"""Free bytes below which a failed write is put down to a full disk."""


def _free_bytes(folder: Path) -> int:
    try:
        return shutil.disk_usage(folder if folder.exists() else folder.parent).free
    except OSError:
        return 1 << 62


def _save_hf_files(accelerator, model, tokenizer, folder: Path) -> None:
    unwrapped = accelerator.unwrap_model(model)
    base = unwrapped.get_base_model() if hasattr(unwrapped, "get_base_model") else unwrapped
    base.config.save_pretrained(folder)
    if getattr(base, "generation_config", None) is not None:
        base.generation_config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    if hasattr(unwrapped, "peft_config"):
        unwrapped.peft_config["default"].save_pretrained(folder)


_ROTATIONS: list = []


def rotate(root: Path, keep_last: int | None, *, newest: int | None = None, background: bool = False) -> list[Path]:
    """Delete all but the newest `keep_last` complete checkpoints up to step `newest` (the one just saved, always
    kept), and the step folders older than the newest one kept that are not complete (damaged, or a save that lost
    its manifest: never resumable, as a newer complete one is read first, so kept forever otherwise). A step folder
    newer than that is left alone, and so is a checkpoint newer than `newest`: complete here means its files have the
    manifest's sizes, and a newer one whose bytes changed since (which a resume goes back past, and keeps aside) must
    not count among the kept, or the checkpoint just written, checked as it was written, would go for it. Returns
    what was removed.

    Each one is first renamed to `.trash-step-N` (atomic: never again seen as a checkpoint), then deleted; with
    `background`, the deletion runs in a thread (`wait_for_rotations` joins it before the process ends). One that a
    reader holds (its `.reading-` lock, `reading` below: a consolidation of a live run's checkpoint) is
    passed over, for a later rotation."""
    if not keep_last:
        return []
    checkpoints = list_checkpoints(root)
    just_saved = checkpoint_name(newest) if newest is not None else None
    upto = [c for c in checkpoints if newest is None or checkpoint_step(c.name) <= newest]
    kept = {c.name for c in [c for c in upto if c.complete or c.name == just_saved][-keep_last:]}
    oldest_kept = min((checkpoint_step(name) for name in kept), default=-1)
    newest_kept = max((checkpoint_step(name) for name in kept), default=-1)
    trashed = []
    for c in checkpoints:
        if c.name in kept or checkpoint_step(c.name) >= (oldest_kept if c.complete else newest_kept):
            continue
        trash = c.path.with_name(TRASH_PREFIX + c.path.name)
        readers = FileLock(reading_lock(c.path))
        try:
            if not readers.acquire(wait=False):  # being read (`accel-fsdp checkpoint consolidate`): a later save's
                continue                         # rotation takes it
        except OSError:
            readers = None
        try:
            os.rename(c.path, trash)
        except OSError:
            continue
        finally:
            if readers is not None:
                readers.release(remove=True)
        trashed.append((c.path, trash))
    for stale in root.glob(f"{TRASH_PREFIX}{STEP_PREFIX}*"):  # left by a process that ended while deleting
        if all(stale != t for _, t in trashed):
            trashed.append((stale, stale))
    for lock in root.glob(f"{READING_PREFIX}{STEP_PREFIX}*"):  # a reader's or a rotation's, killed meanwhile
        if not (root / lock.name.removeprefix(READING_PREFIX)).exists():
            _remove_unheld(lock)

    def delete() -> None:
        for _, trash in trashed:
            shutil.rmtree(trash, ignore_errors=True)

    if background and trashed:
        import threading

        thread = threading.Thread(target=delete, name="accel-fsdp-rotate", daemon=True)
        thread.start()
        _ROTATIONS.append(thread)
    else:
        delete()
    return [original for original, trash in trashed if original != trash]


READ_ATTEMPTS = 5
"""How often `reading` chooses again when rotation took its choice between the choice and the lock."""


@contextlib.contextmanager
def reading(given: str | Path, *, verify: bool = True) -> Iterator[ResumePoint]:
    """The checkpoint `given` names (a checkpoint, or a run folder's newest intact one: checkpoint/index.py
    `resolve_checkpoint`), held against rotation while it is read: a shared lock on its `.reading-` file, which
    `rotate` must take exclusively to delete it, taken before any of its files is read (its CRC-32s with `verify`).
    A live run (checkpoint.keep_last) would otherwise delete the checkpoint a consolidation is reading ("incomplete
    or corrupt" halfway through, every time with a save per step). A choice rotation took before the lock is made
    again. A folder this user cannot write in has no lock file, and nobody rotates there."""
    for _ in range(READ_ATTEMPTS):
        gone: list[Path] = []
        with contextlib.ExitStack() as held:
            def hold(checkpoint: Path) -> bool:  # called within this iteration only
                there = _hold(held, checkpoint)
                if not there:
                    gone.append(checkpoint)
                return there
            try:
                point = resolve_checkpoint(given, verify=verify, hold=hold)
            except UserError:
                if gone:  # rotated away under the choice: choose again
                    continue
                raise
            yield point
            return
    raise UserError(Problem(str(given), f"its run rotated away each of the {READ_ATTEMPTS} checkpoints chosen "
                            "before it could be read", "raise the run's checkpoint.keep_last, or read a checkpoint "
                            "once the run has ended"))


def _hold(held: contextlib.ExitStack, checkpoint: Path) -> bool:
    """Hold `checkpoint`'s reading lock until `held` closes; whether the checkpoint is (still) there."""
    lock = FileLock(reading_lock(checkpoint))
    try:
        lock.acquire(wait=True, shared=True)
    except OSError:  # a folder this user cannot write in
        return checkpoint.is_dir()
    held.callback(_remove_unheld, lock.path)
    held.callback(lock.release)
    return checkpoint.is_dir()


def _remove_unheld(path: Path) -> None:
    """The lock file of a checkpoint no reader holds any more: removed (a reader waiting for it opens it again)."""
    last = FileLock(path)
    try:
        if last.acquire(wait=False):
            last.release(remove=True)
    except OSError:
        pass


def wait_for_rotations() -> None:
    while _ROTATIONS:
        _ROTATIONS.pop().join()


def _rng_state() -> dict[str, Any]:
    import numpy as np

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        # This rank's own device only (Accelerate made it current): the GPUs a rank sees may differ on resume, and
        # get_rng_state_all would save every visible GPU's to be restored by index (torch/cuda/random.py).
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    import numpy as np

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available():
        if isinstance(cuda, (list, tuple)):  # written by an earlier version: every visible GPU's, by index
            index = torch.cuda.current_device()
            cuda = cuda[index] if index < len(cuda) else None
        if cuda is not None:
            torch.cuda.set_rng_state(cuda)  # the current device: this rank's


def _versions() -> dict[str, str]:
    import accelerate
    import transformers


    return {"accel_fsdp": __version__, "torch": torch.__version__, "accelerate": accelerate.__version__,
            "transformers": transformers.__version__}


def _create_optimizer_state(optimizer) -> None:
    """Give AdamW its moments (zeros) before an FSDP1 checkpoint's are read into them. Accelerate reads a sharded
    FSDP1 optimizer state into the keys of `FSDP.optim_state_dict` of the new optimizer (accelerate 1.15.0
    utils/fsdp_utils.py `load_fsdp_optimizer`), and AdamW creates its state at its first step: without this, nothing
    was read and a resumed run went on with fresh moments and step count. FSDP2's path, `get_optimizer_state_dict`,
    does the same itself (torch 2.13.0 distributed/checkpoint/state_dict.py `_init_optim_state`: a step of zero
    gradients at lr 0, which moves no weight, decayed or not)."""
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    _init_optim_state(getattr(optimizer, "optimizer", optimizer))  # the torch optimizer under Accelerate's wrapper


@contextlib.contextmanager
def _state_dict_type(plugin, state_dict_type: str):
    """The plugin set to read or write `state_dict_type` while the block runs, then as it was. Its state dict configs
    go with the type: `set_state_dict_type` makes them only where they are None (accelerate 1.15.0
    utils/dataclasses.py `FullyShardedDataParallelPlugin.set_state_dict_type`), and a run saving FULL_STATE_DICT
    kept `FullStateDictConfig(rank0_only=True)` while reading a sharded checkpoint, which asks torch for a sharded
    load broadcast from rank 0 (utils/fsdp_utils.py `_prepare_sd_options`): refused, so a resume that switched
    checkpoint.state_dict_type (which README promises) failed as if the checkpoint were damaged."""
    saved = plugin.state_dict_type, plugin.state_dict_config, plugin.optim_state_dict_config
    plugin.state_dict_config = plugin.optim_state_dict_config = None
    plugin.set_state_dict_type(state_dict_type)
    try:
        yield
    finally:
        plugin.state_dict_type, plugin.state_dict_config, plugin.optim_state_dict_config = saved


def _jsonable(v):
    if isinstance(v, torch.Tensor):
        return v.tolist()
    return str(v)


# ------------------------------------------------------------------------------------------------- load


def load_checkpoint(accelerator, model, optimizer, scheduler, info: CheckpointInfo, *, lora: bool) -> TrainerState:
    """Restore model, optimizer, scheduler, scaler and RNG states; return the trainer state (its scheduler state
    consumed)."""
    from accelerate.utils import load_fsdp_model, load_fsdp_optimizer

    plugin = accelerator.state.fsdp_plugin
    with _state_dict_type(plugin, info.manifest.state_dict_type):  # read it the way it was written
        with damaged_if_unreadable(info.path, "a model or optimizer shard"):
            load_fsdp_model(plugin, accelerator, model, str(info.path), adapter_only=lora)
            if plugin.fsdp_version == 1:
                _create_optimizer_state(optimizer)
            load_fsdp_optimizer(plugin, accelerator, optimizer, model, str(info.path), adapter_only=lora)
    state = TrainerState.read(info.path)
    if state.scheduler is None:
        raise DamagedRecord(info.path, f"{TRAINER_STATE} is damaged (no scheduler state)")
    scheduler.load_state_dict(state.scheduler)
    state.scheduler = None
    if accelerator.scaler is not None and (info.path / SCALER_FILE).exists():
        with damaged_if_unreadable(info.path, SCALER_FILE):
            accelerator.scaler.load_state_dict(torch.load(info.path / SCALER_FILE, weights_only=True))
    rng = info.path / rng_file(accelerator.process_index)
    if rng.exists() and info.manifest.world_size == accelerator.num_processes:
        with damaged_if_unreadable(info.path, rng.name):
            _set_rng_state(torch.load(rng, weights_only=False))
    accelerator.wait_for_everyone()
    return state
